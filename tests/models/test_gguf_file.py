"""engine/models/gguf_file.py finds a GGUF file's tensors as gguf-py's GGUFReader does (names,
types, dimensions, bytes, architecture) over every metadata value type and alignment (the bundled
file's tensors: test_gguf_blocks.py, against transformers' loader), and a file
that is cut short or has bytes changed is a ValueError, never another error and never a hang."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from engine.models.gguf_file import read_gguf_file


def write(path, alignment=None):
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, quants
    writer = GGUFWriter(str(path), "llama")
    if alignment:
        writer.add_custom_alignment(alignment)
    for kind in ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"):
        getattr(writer, f"add_{kind}")(f"test.{kind}", 7)
    writer.add_float32("test.float32", 0.5)
    writer.add_float64("test.float64", 0.25)
    writer.add_bool("test.bool", True)
    writer.add_string("test.string", "héllo")
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_array("test.strings", ["a", "", "ccc"] * 50)
    writer.add_array("test.empty", [])
    writer.add_key_value("test.nested", [[1, 2], [3]], GGUFValueType.ARRAY, sub_type=GGUFValueType.ARRAY)
    rng = np.random.default_rng(0)
    writer.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.add_tensor("blk.0.ffn_norm.weight", rng.standard_normal((3, 64)).astype(np.float16))
    for name, kind in (("blk.0.attn_q.weight", "Q8_0"), ("blk.0.attn_k.weight", "Q4_1"), ("token_embd.weight", "BF16")):
        values = rng.standard_normal((8, 64)).astype(np.float32)
        writer.add_tensor(name, quants.quantize(values, GGMLQuantizationType[kind]), raw_dtype=GGMLQuantizationType[kind])
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    return path


def assert_as_gguf_py_reads(path):
    from gguf import GGUFReader
    reader, ours = GGUFReader(path), read_gguf_file(path)
    field = reader.fields["general.architecture"]
    assert ours.architecture == bytes(field.parts[field.data[0]]).decode()
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for theirs, mine in zip(reader.tensors, ours.tensors):
        assert mine.type == int(theirs.tensor_type) and mine.dims == tuple(theirs.shape.tolist()), mine.name
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_every_metadata_type_and_alignment_reads_as_gguf_py_reads(tmp_path, alignment):
    assert_as_gguf_py_reads(write(tmp_path / "m.gguf", alignment))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write(tmp_path_factory.mktemp("gguf") / "m.gguf").read_bytes()


def read_or_value_error(path):
    try:
        read_gguf_file(path)
    except ValueError:
        pass


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_file_cut_short_or_changed_is_a_value_error(tmp_path_factory, good, data):
    raw = bytearray(good)
    if data.draw(st.booleans(), "cut"):
        raw = raw[:data.draw(st.integers(0, len(raw) - 1), "length")]
    for _ in range(data.draw(st.integers(1, 4), "changes")):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1), "at")] = data.draw(st.integers(0, 255), "byte")
    path = tmp_path_factory.mktemp("bad") / "m.gguf"
    path.write_bytes(bytes(raw))
    read_or_value_error(path)  # (anything else fails the test; pyproject's timeout catches a hang)


@pytest.mark.parametrize("change, message", [
    (lambda raw: b"GGUX" + raw[4:], "no GGUF magic"),
    (lambda raw: raw[:4] + (1).to_bytes(4, "little") + raw[8:], "GGUF version 1"),
    (lambda raw: raw[:8] + (2 ** 40).to_bytes(8, "little") + raw[16:], "more than the file's"),
    (lambda raw: raw[:24] + (10 ** 9).to_bytes(8, "little") + raw[32:], "a string of 1000000000 bytes"),
    (lambda raw: raw[:len(raw) - 100], "past the file's end"),
])
def test_what_is_wrong_is_named(tmp_path, good, change, message):
    path = tmp_path / "m.gguf"
    path.write_bytes(change(good))
    with pytest.raises(ValueError, match=message):
        read_gguf_file(path)

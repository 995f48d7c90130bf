"""The engine's loop on a thread of its own (`AsyncEngine`): what handlers send it, the threads
that tokenize before it, and the metrics it observes."""

"""The weights keeper: one long-lived process per deployment that holds the model's weights in device memory.

Why: a restart used to reload the model (8B on an H100: 5-20 s of weights, then profiling, then graphs), and
during all of it nothing was served.  The keeper loads the checkpoint once and hands every engine it serves a
handle to the same memory (CUDA IPC on a GPU, shared-memory file descriptors on the CPU), so a new engine needs
only its KV cache: it can start (imports, CUDA context, its model built around the kept weights) while the old
one still drains, and take the GPU the moment the old one exits.  A crashed engine's weights survive too.

Why a separate process rather than each engine exporting its weights to its successor: an engine killed -9,
by the OOM killer or by a CUDA error takes its memory with it; the keeper does nothing but hold memory, so it is
not what dies.  It costs one CUDA context per GPU (about 0.5 GiB), which the memory plan counts.

A keeper that is gone, still loading past its wait, or holding another checkpoint (the key differs) is never an
outage: the engine loads the weights itself, as it always could (`engine_weights_from`, logged).  The supervisor
starts the keeper beside the first engine and again, when it has died, before an engine that needs the GPU
memory it would take (opsctl/keeper.py).

    python -m engine.keeper --socket PATH [engine flags...]
"""

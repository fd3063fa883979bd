"""The CUDA device room: CUDA C in csrc/ (paged decode attention, the KV cache write), compiled at
run time by NVRTC through CuPy and launched on torch's current stream by launch.py. CuPy is
imported only when a kernel is first launched, so this imports without a GPU. The face
(inferd.kernels.ops) is its only caller outside tests and benches."""

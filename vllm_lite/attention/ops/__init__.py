"""Attention kernels: Triton (CUDA; CPU only under TRITON_INTERPRET=1) and the optional csrc
native CPU ops. Import the submodules directly; importing this package imports nothing heavy."""

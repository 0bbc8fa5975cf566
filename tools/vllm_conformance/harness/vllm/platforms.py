"""Stub of vllm.platforms.current_platform: the harness runs on CPU."""


class _CpuPlatform:
    def is_rocm(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return True


current_platform = _CpuPlatform()

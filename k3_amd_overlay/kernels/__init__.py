"""The overlay's own Triton kernels (ROCm and CUDA). The kernel modules import triton and are
imported only when a Triton provider runs; the launch-config, target, launch and probe modules
import no Triton (the installer reads them at layer install), and ``names`` (the kernels' names for
the census) imports nothing."""

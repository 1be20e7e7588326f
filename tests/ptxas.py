"""Registers and spills of a kernel's PTX for sm_90a, from the ptxas that the triton package
bundles (no GPU needed): what the compile tests of the GPU kernels assert on."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile


def ptxas_usage(ptx: str) -> dict[str, int]:
    """PTX text -> {"regs": registers a thread, "spilled": bytes of spill stores and loads}."""
    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        info = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    return dict(regs=int(re.search(r"Used (\d+) registers", info).group(1)),
                spilled=sum(map(int, re.findall(r"(\d+) bytes spill (?:stores|loads)", info))))

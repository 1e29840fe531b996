"""Finding, configuring and loading DeepGEMM and its JIT (our adapter code).

DeepGEMM's source is not part of lpmoe: it is fetched into the git-ignored
folder ``.peers/DeepGEMM`` and imported from there when present.  Pinned
commit: deepseek-ai/DeepGEMM 03d0be3d2d03b6eed3c99d683c0620949a13a826
(2025-07-02), the last one before its C++ extension (deep_gemm_cpp) came in;
to recreate the folder, ``git archive`` that commit of a clone into
.peers/DeepGEMM and write the hash to .peers/DeepGEMM/LPMOE_PEER_COMMIT.
That commit's JIT is pure Python: it writes a small .cu file per kernel
configuration, compiles it to a cubin with nvcc at run time against its own
headers plus the CUTLASS/CuTe headers, and launches it through cuda-bindings
(the cuda-python driver bindings).  Nothing of it is built ahead of time.

What this module sets up, without editing DeepGEMM's files:
  * the CUTLASS/CuTe include folder ($LPMOE_CUTLASS_INCLUDE; else the
    nvidia-cutlass wheel's ``cutlass_library/source/include``, found on
    sys.path or in /tmp/site where tools/gpu_check.sh unpacks .whl/; else
    ``$CUTLASS_PATH/include``; else DeepGEMM's own submodule if it was
    fetched) is added to the include list of its compilers (the submodule
    that its setup.py would link in is absent from the exported tree);
  * nvcc: $DG_JIT_NVCC_COMPILER if set, else torch's CUDA_HOME, else `nvcc` on
    PATH, else /usr/local/cuda (its CUDA_HOME is filled in when torch found none);
  * the kernel loader: DeepGEMM finds the kernel's name in the cubin with
    cuobjdump; if that fails (no cuobjdump, or a listing it does not expect),
    the cubin is loaded again and its single kernel taken from the driver's
    own list (cuLibraryEnumerateKernels);
  * a launch status other than success raises (DeepGEMM drops it);
  * compile-only threads (``_tls.compile_only``, set by the peer's
    precompile()) stop before loading or launching a kernel.
With nvcc >= 12.9 DeepGEMM skips its SASS post-pass (FFMA interleaving) by
its own rule; kernels build with nvcc 13.0 and CUTLASS 4.2 headers.

Environment: LPMOE_DEEPGEMM_DIR (another DeepGEMM tree), LPMOE_CUTLASS_INCLUDE,
DeepGEMM's own DG_JIT_* variables (DG_JIT_CACHE_DIR, DG_JIT_DEBUG,
DG_JIT_NVCC_COMPILER, DG_JIT_PRINT_COMPILER_COMMAND, ...).

The operands, GEMM callables, correctness check and command line are in
_deepgemm_peer.py, the module the benchmarks import.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Dict, List, Optional

import torch

PINNED_COMMIT = "03d0be3d2d03b6eed3c99d683c0620949a13a826"
REPO = Path(__file__).resolve().parent.parent
PEER_DIR = Path(os.environ.get("LPMOE_DEEPGEMM_DIR") or REPO / ".peers" / "DeepGEMM")

_state: Dict[str, object] = {"tried": False, "mod": None, "reason": "not loaded yet", "desc": ""}
_tls = threading.local()   # compile_only flag of precompile()'s threads


def commit() -> Optional[str]:
    f = PEER_DIR / "LPMOE_PEER_COMMIT"
    return f.read_text().strip() if f.is_file() else None


def _has_cutlass(inc: Optional[str]) -> bool:
    return bool(inc) and os.path.isfile(os.path.join(inc, "cute", "arch", "copy_sm90_tma.hpp")) \
        and os.path.isfile(os.path.join(inc, "cutlass", "arch", "barrier.h"))


def cutlass_include() -> Optional[str]:
    """Folder holding cute/ and cutlass/ (headers only)."""
    cands: List[str] = []
    if os.environ.get("LPMOE_CUTLASS_INCLUDE"):
        cands.append(os.environ["LPMOE_CUTLASS_INCLUDE"])
    spec = importlib.util.find_spec("cutlass_library")   # nvidia-cutlass wheel, not imported
    if spec is not None and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            cands.append(os.path.join(base, "source", "include"))
    if os.environ.get("CUTLASS_PATH"):
        cands.append(os.path.join(os.environ["CUTLASS_PATH"], "include"))
    # where tools/gpu_check.sh unpacks the carried .whl/ (it runs the benchmarks with a
    # PYTHONPATH that no longer names that folder)
    cands.append("/tmp/site/cutlass_library/source/include")
    cands.append(str(PEER_DIR / "third-party" / "cutlass" / "include"))
    return next((c for c in cands if _has_cutlass(c)), None)


def _cuda_home() -> Optional[str]:
    from torch.utils import cpp_extension
    if cpp_extension.CUDA_HOME:
        return cpp_extension.CUDA_HOME
    nvcc = shutil.which("nvcc")
    if nvcc:
        return str(Path(nvcc).resolve().parent.parent)
    return "/usr/local/cuda" if os.path.exists("/usr/local/cuda/bin/nvcc") else None


def _load_single_kernel(cubin: str):
    """(library, kernel) of a cubin that holds one kernel, from the driver's list."""
    import cuda.bindings.driver as cbd
    ok = cbd.CUresult.CUDA_SUCCESS
    err, lib = cbd.cuLibraryLoadFromFile(cubin.encode(), [], [], 0, [], [], 0)
    if err != ok:
        raise RuntimeError(f"cuLibraryLoadFromFile({cubin}): {err}")
    err, count = cbd.cuLibraryGetKernelCount(lib)
    if err != ok:
        raise RuntimeError(f"cuLibraryGetKernelCount: {err}")
    err, kernels = cbd.cuLibraryEnumerateKernels(count, lib)
    if err != ok or len(kernels) != 1:
        names = []
        for k in kernels or []:
            try:
                names.append(cbd.cuKernelGetName(k)[1])
            except Exception:  # noqa: BLE001 - only for the message
                pass
        raise RuntimeError(f"{cubin}: expected one kernel, found {count} {names} ({err})")
    return lib, kernels[0]


def _configure(dg) -> str:
    """Point DeepGEMM's JIT at nvcc and the CUTLASS headers; returns a description."""
    from deep_gemm.jit import compiler as dgc
    from deep_gemm.jit import runtime as dgr

    inc = cutlass_include()
    if inc is None:
        raise RuntimeError("no CUTLASS/CuTe headers (pip install nvidia-cutlass, or set LPMOE_CUTLASS_INCLUDE)")
    home = _cuda_home()
    if home is None and not os.environ.get("DG_JIT_NVCC_COMPILER"):
        raise RuntimeError("no nvcc (set DG_JIT_NVCC_COMPILER or CUDA_HOME)")
    # DeepGEMM reads CUDA_HOME (nvcc, cuobjdump) as a module global taken from torch.
    for mod in (dgc, dgr):
        if getattr(mod, "CUDA_HOME", None) is None and home is not None:
            mod.CUDA_HOME = home

    jit_inc = dgc.get_jit_include_dir()
    base_nvrtc = dgc.NVRTCCompiler.include_dirs
    dgc.Compiler.include_dirs = staticmethod(lambda: [jit_inc, inc])            # NVCC path
    dgc.NVRTCCompiler.include_dirs = staticmethod(lambda: [*base_nvrtc(), inc])  # DG_JIT_USE_NVRTC=1

    # Kernel loading: DeepGEMM's cuobjdump-based lookup first, the driver's list if it fails;
    # compile-only threads (precompile) stop before loading or launching anything.  A launch
    # that the driver refuses raises here (DeepGEMM's callers drop the status it returns, and
    # a refused launch would otherwise be timed as a very fast GEMM).
    if not getattr(dgr.Runtime, "_lpmoe_wrapped", False):
        import cuda.bindings.driver as cbd
        orig_call = dgr.Runtime.__call__

        def checked(self, **kwargs):
            res = orig_call(self, **kwargs)
            err = res[0] if isinstance(res, tuple) else res
            if err is not None and err != cbd.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"DeepGEMM launch of {os.path.basename(self.path)} failed: {err}")
            return res

        def call(self, **kwargs):
            if getattr(_tls, "compile_only", False):
                return None
            if self.kernel is None:
                try:
                    return checked(self, **kwargs)
                except (AssertionError, FileNotFoundError, OSError) as exc:
                    if self.kernel is not None:   # loaded: the launch itself failed
                        raise
                    if self.lib is not None:
                        cbd.cuLibraryUnload(self.lib)
                    self.lib, self.kernel = None, None
                    self.lib, self.kernel = _load_single_kernel(os.path.join(self.path, "kernel.cubin"))
                    if not _state.get("fallback_said"):
                        _state["fallback_said"] = True
                        print(f"    (DeepGEMM kernel lookup through cuobjdump failed ({exc!r}); "
                              "using the driver's kernel list)")
            return checked(self, **kwargs)

        dgr.Runtime.__call__ = call
        dgr.Runtime._lpmoe_wrapped = True

    nvcc, ver = dgc.get_nvcc_compiler()
    mode = "NVRTC" if int(os.getenv("DG_JIT_USE_NVRTC", 0)) else f"nvcc {ver}"
    got = commit()
    pin = "" if got == PINNED_COMMIT else f", NOT the pinned {PINNED_COMMIT[:12]}"
    return f"DeepGEMM {(got or 'unknown commit')[:12]} ({mode}{pin}, CUTLASS headers {inc})"


def load():
    """deep_gemm, configured, or None (then reason() says why).  Tried once."""
    if _state["tried"]:
        return _state["mod"]
    _state["tried"] = True
    try:
        if not (PEER_DIR / "deep_gemm" / "__init__.py").is_file():
            raise RuntimeError(f"{PEER_DIR} absent (export DeepGEMM {PINNED_COMMIT[:12]} there to add the column)")
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        cap = torch.cuda.get_device_capability()
        if cap != (9, 0):
            raise RuntimeError(f"this DeepGEMM commit builds sm_90a only; device is sm_{cap[0]}{cap[1]}")
        if str(PEER_DIR) not in sys.path:
            sys.path.insert(0, str(PEER_DIR))
        import deep_gemm as dg
        if not hasattr(dg, "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous"):
            raise RuntimeError(f"{PEER_DIR}: no m_grouped_gemm_fp8_fp8_bf16_nt_contiguous")
        _state["desc"] = _configure(dg)
        _state["mod"], _state["reason"] = dg, ""
    except Exception as exc:  # any failure only removes the column
        _state["mod"], _state["reason"] = None, f"{type(exc).__name__}: {str(exc)[:200]}"
    return _state["mod"]


def available() -> bool:
    return load() is not None


def reason() -> str:
    return str(_state["reason"])


def describe() -> str:
    return str(_state["desc"])


def disable(why: str) -> None:
    """Drop the column for the rest of the run (e.g. a failed check)."""
    _state["tried"], _state["mod"], _state["reason"] = True, None, why

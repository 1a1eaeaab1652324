#!/usr/bin/env python3
r"""Compile every kernel family under kernels/ with NVRTC, without a GPU.

Each family file `kernels/<family>.cu` is compiled exactly as the CUDA backend compiles it at run
time: `#line 1 "common.cuh"\n`, the text of `kernels/common.cuh`, the family's own headers
(`<family>_*.cuh`, each after its `#line 1`), `#line 1 "<family>.cu"\n`, then
the family file (the #line directives make messages name the right file and line), as one NVRTC
program named `<family>.cu`, with the options

    --gpu-architecture=sm_XX -std=c++17 --fmad=false -I<cuda include dir> --ptxas-options=-v

(`-I` only when an include dir is known). The result is fetched as a cubin with `nvrtcGetCUBIN`
(never PTX). For every kernel one line is printed:

    <file> <arch> <kernel> regs=<n> spill_stores=<bytes> spill_loads=<bytes> stack=<bytes> smem=<bytes>

The exit status is non-zero when a file fails to compile, when any kernel spills, or when the
compiler prints a warning (unless --allow-warnings).

Usage:
    python3 kernels/check_nvrtc.py [--nvrtc LIB] [--include DIR] [--arch sm_80 --arch sm_90]
                                   [--out DIR] [--allow-warnings] [--quiet] [FILE.cu ...]

    --nvrtc LIB     libnvrtc.so.* to load (else $MPC_NVRTC_LIB, else searched for in the installed
                    `nvidia` Python packages: nvidia-cuda-nvrtc; else the system's libnvrtc.so)
    --include DIR   folder holding cuda_fp16.h / cuda_bf16.h (else $MPC_CUDA_INCLUDE, else searched
                    for in the installed `nvidia` packages: nvidia-cuda-runtime)
    --arch ARCH     a real architecture, repeatable (default: sm_80 and sm_90)
    --out DIR       also write each cubin to DIR/<family>.<arch>.cubin
    FILE.cu         the families to check (default: every *.cu beside this script)

The wheels that provide NVRTC and the headers without a CUDA toolkit:
    pip install --target DIR "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*"
and then PYTHONPATH=DIR (or pass --nvrtc/--include).
"""

import argparse
import ctypes
import glob
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def nvidia_roots():
    """The `nvidia` namespace package folders importable from this interpreter."""
    roots = []
    try:
        import nvidia  # noqa: F401  (namespace package from the nvidia-* wheels)

        roots.extend(list(getattr(nvidia, "__path__", [])))
    except ImportError:
        pass
    for p in sys.path:
        cand = os.path.join(p, "nvidia")
        if os.path.isdir(cand) and cand not in roots:
            roots.append(cand)
    return roots


def find_nvrtc(explicit):
    if explicit:
        return explicit
    if os.environ.get("MPC_NVRTC_LIB"):
        return os.environ["MPC_NVRTC_LIB"]
    hits = []
    for root in nvidia_roots():
        hits += glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*"))
        hits += glob.glob(os.path.join(root, "*", "*", "lib", "libnvrtc.so*"))
    # Prefer the plain library (not the .alt variant, not the builtins).
    hits = [h for h in hits if ".alt." not in h and "builtins" not in h]
    if hits:
        return sorted(hits)[-1]
    return "libnvrtc.so"  # whatever the dynamic loader finds


def find_include(explicit):
    if explicit:
        return explicit
    if os.environ.get("MPC_CUDA_INCLUDE"):
        return os.environ["MPC_CUDA_INCLUDE"]
    for root in nvidia_roots():
        for pattern in ("*/include/cuda_fp16.h", "*/*/include/cuda_fp16.h"):
            hits = sorted(glob.glob(os.path.join(root, pattern)))
            if hits:
                return os.path.dirname(hits[-1])
    for cand in ("/usr/local/cuda/include", "/usr/include"):
        if os.path.exists(os.path.join(cand, "cuda_fp16.h")):
            return cand
    return None


class Nvrtc:
    def __init__(self, path):
        # NVRTC dlopens libnvrtc-builtins by name; load the one beside the library first so that a
        # wheel's copy is found without LD_LIBRARY_PATH.
        folder = os.path.dirname(path)
        if folder:
            for b in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so*"))):
                if ".alt." not in b:
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(path)
        L = self.lib
        L.nvrtcGetErrorString.restype = ctypes.c_char_p
        L.nvrtcGetErrorString.argtypes = [ctypes.c_int]
        L.nvrtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        L.nvrtcCreateProgram.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_char_p),
            ctypes.POINTER(ctypes.c_char_p),
        ]
        L.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        L.nvrtcGetProgramLogSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        L.nvrtcGetProgramLog.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        L.nvrtcGetCUBINSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        L.nvrtcGetCUBIN.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        L.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]

    def check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(rc).decode()}")

    def version(self):
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def compile(self, source, name, options):
        """Returns (ok, log, cubin bytes or None)."""
        L = self.lib
        prog = ctypes.c_void_p()
        self.check(
            L.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
            "nvrtcCreateProgram",
        )
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            rc = L.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.check(L.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
            buf = ctypes.create_string_buffer(size.value)
            self.check(L.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
            log = buf.value.decode(errors="replace")
            if rc != 0:
                return False, log + f"\n[{L.nvrtcGetErrorString(rc).decode()}]", None
            self.check(L.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self.check(L.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return True, log, cubin.raw
        finally:
            L.nvrtcDestroyProgram(ctypes.byref(prog))


ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
PROPS = re.compile(r"Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")
SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log):
    """Per kernel: registers, spills, stack and static shared memory from ptxas -v output."""
    kernels = {}
    order = []
    current = None
    for line in log.splitlines():
        m = ENTRY.search(line)
        if m:
            current = m.group(1)
            if current not in kernels:
                kernels[current] = {"regs": None, "stack": 0, "spill_st": 0, "spill_ld": 0, "smem": 0}
                order.append(current)
            continue
        m = PROPS.search(line)
        if m:
            name = m.group(1)
            current = name if name in kernels else None
            continue
        if current is None:
            continue
        m = FRAME.search(line)
        if m:
            k = kernels[current]
            k["stack"], k["spill_st"], k["spill_ld"] = (int(m.group(i)) for i in (1, 2, 3))
            continue
        m = USED.search(line)
        if m:
            kernels[current]["regs"] = int(m.group(1))
            s = SMEM.search(line)
            if s:
                kernels[current]["smem"] = int(s.group(1))
    return order, kernels


def warnings_in(log):
    return [l for l in log.splitlines() if re.search(r":\s*warning\b", l, re.IGNORECASE)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvrtc")
    ap.add_argument("--include")
    ap.add_argument("--arch", action="append")
    ap.add_argument("--out")
    ap.add_argument("--allow-warnings", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="print failures and the totals only")
    ap.add_argument("files", nargs="*")
    a = ap.parse_args()

    lib = find_nvrtc(a.nvrtc)
    include = find_include(a.include)
    try:
        nv = Nvrtc(lib)
    except OSError as e:
        print(f"cannot load NVRTC from {lib}: {e}", file=sys.stderr)
        return 2
    major, minor = nv.version()
    print(f"NVRTC {major}.{minor} from {lib}; headers from {include or '(NVRTC built-ins only)'}")

    archs = a.arch or ["sm_80", "sm_90"]
    files = a.files or sorted(glob.glob(os.path.join(HERE, "*.cu")))
    with open(os.path.join(HERE, "common.cuh")) as f:
        common = f.read()
    if a.out:
        os.makedirs(a.out, exist_ok=True)

    failures = 0
    n_kernels = 0
    worst = {}
    for path in files:
        family = os.path.splitext(os.path.basename(path))[0]
        # A family's own headers (`<family>_*.cuh` beside it, as attention_mma.cuh) come between.
        source = '#line 1 "common.cuh"\n' + common + "\n"
        for header in sorted(glob.glob(os.path.join(os.path.dirname(path), f"{family}_*.cuh"))):
            with open(header) as f:
                source += f'#line 1 "{os.path.basename(header)}"\n' + f.read()
        with open(path) as f:
            source += f'#line 1 "{family}.cu"\n' + f.read()
        for arch in archs:
            opts = [f"--gpu-architecture={arch}", "-std=c++17", "--fmad=false", "--ptxas-options=-v"]
            if include:
                opts.append(f"-I{include}")
            ok, log, cubin = nv.compile(source, family + ".cu", opts)
            if not ok:
                failures += 1
                print(f"FAIL {family}.cu {arch}: compile error\n{log}")
                continue
            warns = warnings_in(log)
            if warns:
                print(f"{'WARN' if a.allow_warnings else 'FAIL'} {family}.cu {arch}: {len(warns)} warning(s)")
                for w in warns:
                    print("    " + w)
                if not a.allow_warnings:
                    failures += 1
            if not cubin.startswith(b"\x7fELF"):
                failures += 1
                print(f"FAIL {family}.cu {arch}: nvrtcGetCUBIN did not return an ELF cubin")
            if a.out:
                with open(os.path.join(a.out, f"{family}.{arch}.cubin"), "wb") as f:
                    f.write(cubin)
            order, kernels = parse_ptxas(log)
            if not order:
                failures += 1
                print(f"FAIL {family}.cu {arch}: no kernels found in the ptxas log")
            for name in order:
                k = kernels[name]
                n_kernels += 1
                spill = k["spill_st"] or k["spill_ld"]
                if spill:
                    failures += 1
                key = (family, arch)
                if k["regs"] is not None and k["regs"] > worst.get(key, (0, ""))[0]:
                    worst[key] = (k["regs"], name)
                if spill or not a.quiet:
                    print(
                        f"{'SPILL ' if spill else ''}{family}.cu {arch} {name} regs={k['regs']} "
                        f"spill_stores={k['spill_st']} spill_loads={k['spill_ld']} stack={k['stack']} "
                        f"smem={k['smem']}"
                    )
    for (family, arch), (regs, name) in sorted(worst.items()):
        print(f"max registers {family}.cu {arch}: {regs} ({name})")
    print(f"{n_kernels} kernel compilations over {len(files)} file(s) x {len(archs)} arch(s); {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

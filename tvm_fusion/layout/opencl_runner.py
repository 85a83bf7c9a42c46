"""Run TVM-generated OpenCL kernels, buffers and image2d textures, on PoCL through pyopencl.

The pip TVM wheel generates OpenCL source but has no OpenCL runtime, so for tests we run the
kernels ourselves: each PrimFunc is built with ``tvm.tirx.build`` and its host code, captured
right after ``SplitHostDevice``, tells which device kernels it launches, in what order, with
which arguments and launch sizes (``call_ffi_kernel``). Buffers become ``cl.Buffer``;
``global.texture`` parameters become RGBA ``image2d_array`` images laid out as TVM's runtime
lays them out (``ApplyTexture2DFlattening``: ``[..., Y, X, 4]`` is depth × height × width).

:meth:`OpenCLRunner.run_module` executes a Relax ``main`` of ``call_tir`` bindings (as our
passes leave it, before VM lowering), kernel after kernel, reading every result back to the
host in its physical layout and uploading it again for its consumers.

fp16: PoCL has no ``cl_khr_fp16``. With ``fp16_shim=True`` the source is rewritten so ``half``
is ``float`` and ``read_imageh``/``write_imageh`` are their ``f`` forms; images stay
``CL_HALF_FLOAT`` (stores round to fp16), buffers are float32 on the device. That checks the
indexing, layouts and texel stores of fp16 kernels, not fp16 arithmetic.

Install (Debian/Ubuntu): ``apt-get install -y pocl-opencl-icd ocl-icd-libopencl1 clinfo`` and
``pip install pyopencl``; :func:`available` says why it cannot run otherwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx

from ..tir_utils import find_all
from .texture_lower import OUR_PIPELINE, is_texture_scope, register_tir_pipelines

_CALL_TIR = "relax.call_tir"


def available() -> tuple[bool, str]:
    """(True, device) when pyopencl and an OpenCL device with image support are present."""
    try:
        import pyopencl as cl
    except ImportError:
        return False, "pyopencl is not installed (pip install pyopencl)"
    try:
        platforms = cl.get_platforms()
    except Exception as err:  # noqa: BLE001 (no ICD loader or no platform)
        return False, f"no OpenCL platform ({err}); apt-get install pocl-opencl-icd"
    for platform in platforms:
        for device in platform.get_devices():
            if device.image_support:
                return True, f"{platform.name}: {device.name}"
    return False, "no OpenCL device with image support"


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    dtype: str
    scope: str

    @property
    def texture(self) -> bool:
        return is_texture_scope(self.scope)


@dataclass(frozen=True)
class Launch:
    kernel: str
    args: tuple[str, ...]  # parameter or workspace names, in the kernel's argument order
    global_size: tuple[int, ...]
    local_size: tuple[int, ...]


@dataclass
class CompiledKernel:
    """One PrimFunc: OpenCL source, its parameters and the launches its host code makes."""

    name: str
    source: str
    params: list[Param]
    launches: list[Launch]
    workspaces: dict[str, tuple[int, str]] = field(default_factory=dict)  # name -> (n, dtype)


def compile_primfunc(func: tirx.PrimFunc, target, pipeline: str = OUR_PIPELINE,
                     name: str = "kernel") -> CompiledKernel:
    """Build one scheduled PrimFunc for an OpenCL target and read its launch plan."""
    register_tir_pipelines()
    target = _with_host(target)
    captured = {}

    @tvm.ir.instrument.pass_instrument
    class _Capture:
        def run_after_pass(self, mod, info):
            if info.name.endswith("SplitHostDevice"):
                captured["mod"] = mod

    func = func.with_attr("global_symbol", name)
    with tvm.transform.PassContext(instruments=[_Capture()]):
        lib = tvm.tirx.build(tvm.IRModule({name: func}), target=target, pipeline=pipeline)
    source = "\n".join(m.inspect_source() for m in _walk(lib) if m.kind == "opencl")
    params = [Param(p.name, tuple(int(d) for d in p.shape), str(p.dtype), p.scope())
              for p in func.params]
    host = captured["mod"][name]
    launches, workspaces = _launch_plan(host, [p.name for p in params])
    return CompiledKernel(name, source, params, launches, workspaces)


def specialize_sizes(func: tirx.PrimFunc, inputs: list) -> tuple[tirx.PrimFunc, tuple]:
    """``func`` with its symbolic sizes bound to those of ``inputs`` (arrays for its first
    parameters), and the sizes as a cache key: the runner launches static kernels, so a
    symbolic-length kernel runs as itself specialised to each length (the same generated
    code, its sizes constant)."""
    sizes: dict = {}
    for param, array in zip(func.params, inputs):
        shape = getattr(param.ty, "shape", None)
        if shape is None or not hasattr(array, "shape"):
            continue
        for dim, n in zip(shape, array.shape):
            if isinstance(dim, tirx.Var):
                sizes.setdefault(dim, int(n))
    if not sizes:
        return func, ()

    def bind(var):
        for size, n in sizes.items():
            if var.same_as(size):
                return tirx.const(n, str(var.ty))
        return var

    key = tuple(sorted((str(v.name), n) for v, n in sizes.items()))
    return tvm_ffi.structural_map(func, [(tvm.ir.Var, bind)]), key


def _with_host(target):
    target = tvm.target.Target(target) if not isinstance(target, tvm.target.Target) else target
    return target if target.host is not None else tvm.target.Target(target, host="llvm")


def _walk(module):
    yield module
    for imported in module.imports:
        yield from _walk(imported)


def _launch_plan(host: tirx.PrimFunc, param_names: list[str]):
    """Kernel launches and workspaces of a host function after ``SplitHostDevice``."""
    params = list(host.params)
    alias: dict = {}  # buffer views (DeclBuffer) -> the variable whose data they view
    for node in find_all(host.body, tirx.stmt.DeclBuffer):
        data = node.data
        if isinstance(data, tvm.ir.expr.Call) and data.op.name.endswith("buffer_data"):
            alias[node.buffer] = data.args[0]
    workspaces = {}
    alloc_types = tuple(t for t in (getattr(tirx.stmt, "AllocBuffer", None),) if t)
    for node in find_all(host.body, alloc_types) if alloc_types else []:
        buf = node.buffer
        count = 1
        for d in buf.shape:
            count *= int(d)
        workspaces[buf.name] = (count, str(buf.dtype))

    def resolve(var) -> str:
        seen = 0
        while var in alias and seen < 16:
            var, seen = alias[var], seen + 1
        for p, name in zip(params, param_names):
            if var.same_as(p):
                return name
        return var.name

    launches = []
    for call in find_all(host.body, tvm.ir.expr.Call):
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name.endswith("call_ffi_kernel")):
            continue
        kernel = call.args[0].value
        tags = list(call.attrs.launch_params) if call.attrs is not None else []
        tags = [t for t in tags if "Idx" in t]
        dims = [int(a) for a in call.args[len(call.args) - len(tags):]]
        data = call.args[1:len(call.args) - len(tags)]
        names = []
        for arg in data:
            if isinstance(arg, tvm.ir.expr.Call) and arg.op.name.endswith("buffer_data"):
                names.append(resolve(arg.args[0]))
            else:
                raise NotImplementedError(f"{kernel}: scalar kernel argument {arg} (dynamic "
                                          "shapes are not supported by the test runner)")
        blocks = {t: d for t, d in zip(tags, dims) if t.startswith("blockIdx")}
        threads = {t: d for t, d in zip(tags, dims) if t.startswith("threadIdx")}
        rank = max([_axis(t) for t in tags] + [0]) + 1
        local = tuple(threads.get(f"threadIdx.{'xyz'[i]}", 1) for i in range(rank))
        grid = tuple(blocks.get(f"blockIdx.{'xyz'[i]}", 1) * local[i] for i in range(rank))
        launches.append(Launch(kernel, tuple(names), grid, local))
    return launches, workspaces


def _axis(tag: str) -> int:
    return "xyz".index(tag[-1])


def image_extent(shape: tuple[int, ...], scope: str) -> tuple[int, int, int]:
    """(width, height, depth) of a texture parameter, as TVM's runtime flattens it."""
    dims = list(shape)
    if dims[-1] != 4:
        raise ValueError(f"texture of shape {shape}: the innermost dimension must be 4 (RGBA)")
    body = dims[:-1]
    if scope == "global.texture-weight":
        return int(np.prod(body[1:])), body[0], 1
    if scope == "global.texture-nhwc":
        return int(np.prod(body[2:])), body[1], body[0]
    return body[-1], (body[-2] if len(body) > 1 else 1), int(np.prod(body[:-2]) or 1)


def fp16_shim(source: str) -> str:
    """Make fp16 kernels compile without ``cl_khr_fp16`` (PoCL): half arithmetic in fp32."""
    source = re.sub(r"#ifdef cl_khr_fp16.*?#endif", "", source, flags=re.S)
    source = re.sub(r"#pragma OPENCL EXTENSION cl_khr_fp16 : enable", "", source)
    head = ["#define half float"] + [f"#define half{n} float{n}" for n in (2, 3, 4, 8, 16)]
    head += ["#define read_imageh read_imagef", "#define write_imageh write_imagef",
             "#define as_half4(x) (x)", "#define as_half2(x) (x)", "#define as_half(x) (x)",
             "#define convert_half(x) ((float)(x))"]
    return "\n".join(head) + "\n" + source


class OpenCLRunner:
    """Runs :class:`CompiledKernel` objects on the first OpenCL device with image support."""

    def __init__(self, fp16_shim: bool = True):
        import pyopencl as cl

        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        self.cl = cl
        device = next(d for p in cl.get_platforms() for d in p.get_devices() if d.image_support)
        self.ctx = cl.Context([device])
        self.queue = cl.CommandQueue(self.ctx)
        self.fp16_shim = fp16_shim
        self._programs: dict[str, object] = {}

    # --------------------------------------------------------------------------- one kernel

    def run(self, compiled: CompiledKernel, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run ``compiled`` with ``arrays`` (by parameter name, physical layout) for its inputs;
        returns every parameter not given, i.e. the outputs, as numpy arrays."""
        cl = self.cl
        program = self._program(compiled)
        objects = {}
        for param in compiled.params:
            host = arrays.get(param.name)
            objects[param.name] = self._upload(param, host)
        for name, (count, dtype) in compiled.workspaces.items():
            lanes = int(dtype.split("x")[1]) if "x" in dtype else 1  # float32x4 workspaces
            objects[name] = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE,
                                      max(count, 1) * lanes * self._device_dtype(dtype).itemsize)
        for launch in compiled.launches:
            kernel = cl.Kernel(program, launch.kernel)  # attribute access warns when repeated
            kernel.set_args(*[objects[a] for a in launch.args])
            cl.enqueue_nd_range_kernel(self.queue, kernel, launch.global_size, launch.local_size)
        self.queue.finish()
        return {p.name: self._download(p, objects[p.name]) for p in compiled.params
                if p.name not in arrays}

    def _program(self, compiled: CompiledKernel):
        source = compiled.source
        if self.fp16_shim and ("half" in source or "cl_khr_fp16" in source):
            source = fp16_shim(source)
        if source not in self._programs:
            self._programs[source] = self.cl.Program(self.ctx, source).build()
        return self._programs[source]

    def _device_dtype(self, dtype: str) -> np.dtype:
        if dtype.startswith("float16") and self.fp16_shim:
            return np.dtype("float32")  # the shim computes and stores buffers in fp32
        base = dtype.split("x")[0]
        return np.dtype(base)

    def _upload(self, param: Param, host: np.ndarray | None):
        cl = self.cl
        if param.texture:
            width, height, depth = image_extent(param.shape, param.scope)
            channel = cl.channel_type.HALF_FLOAT if param.dtype == "float16" else (
                cl.channel_type.FLOAT)
            fmt = cl.ImageFormat(cl.channel_order.RGBA, channel)
            flags = cl.mem_flags.READ_WRITE
            data = None
            if host is not None:
                data = np.ascontiguousarray(host.reshape(depth, height, width, 4),
                                            dtype=np.dtype(param.dtype))
                flags |= cl.mem_flags.COPY_HOST_PTR
            make = getattr(cl, "create_image", cl.Image)  # pyopencl ≥ 2025 prefers create_image
            return make(self.ctx, flags, fmt, shape=(width, height, depth), is_array=True,
                        hostbuf=data)
        dtype = self._device_dtype(param.dtype)
        size = int(np.prod(param.shape)) if param.shape else 1
        if host is None:
            return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, max(size, 1) * dtype.itemsize)
        data = np.ascontiguousarray(host, dtype=dtype)
        return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                         hostbuf=data)

    def _download(self, param: Param, obj) -> np.ndarray:
        cl = self.cl
        if param.texture:
            width, height, depth = image_extent(param.shape, param.scope)
            out = np.empty((depth, height, width, 4), np.dtype(param.dtype))
            cl.enqueue_copy(self.queue, out, obj, origin=(0, 0, 0),
                            region=(width, height, depth))
            return out.reshape(param.shape)
        out = np.empty(param.shape, self._device_dtype(param.dtype))
        cl.enqueue_copy(self.queue, out, obj)
        return out.astype(param.dtype.split("x")[0])

    # -------------------------------------------------------------------------- a module

    def run_module(self, mod: tvm.IRModule, inputs: list[np.ndarray], target,
                   pipeline: str = OUR_PIPELINE, func: str = "main") -> list[np.ndarray]:
        """Execute ``mod[func]`` (a Relax function of ``call_tir`` bindings) on the device."""
        main = mod[func]
        values: dict = dict(zip(list(main.params), inputs))
        compiled: dict[str, CompiledKernel] = {}
        for block in main.body.blocks:
            for binding in block.bindings:
                values[binding.var] = self._eval(binding.value, values, mod, target, pipeline,
                                                 compiled)
        result = self._value(main.body.body, values)
        return list(result) if isinstance(result, tuple) else [result]

    def _value(self, expr, values):
        if isinstance(expr, relax.Var):
            return values[expr]
        if isinstance(expr, relax.Tuple):
            return tuple(self._value(f, values) for f in expr.fields)
        if isinstance(expr, tvm.ir.expr.GenericConst):
            return expr.value.numpy()
        raise NotImplementedError(f"the test runner cannot evaluate {type(expr).__name__}")

    def _eval(self, value, values, mod, target, pipeline, compiled):
        if isinstance(value, relax.TupleGetItem):
            return self._value(value.tuple_value, values)[value.index]
        if isinstance(value, relax.Var | relax.Tuple):
            return self._value(value, values)
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                and value.op.name == _CALL_TIR):
            name = value.op.name if isinstance(value, relax.Call) else type(value).__name__
            raise NotImplementedError(f"the test runner only runs call_tir, not {name}")
        gvar = value.args[0]
        args = value.args[1].fields if isinstance(value.args[1], relax.Tuple) else [
            value.args[1]]
        inputs = [self._value(a, values) for a in args]
        func, sizes = specialize_sizes(mod[gvar], inputs)
        key = (gvar.name_hint, sizes)
        if key not in compiled:
            compiled[key] = compile_primfunc(func, target, pipeline, gvar.name_hint)
        kernel = compiled[key]
        arrays = {p.name: x for p, x in zip(kernel.params, inputs)}
        outs = self.run(kernel, arrays)
        results = [outs[p.name] for p in kernel.params[len(args):]]
        return results[0] if len(results) == 1 else tuple(results)

//! What a plan is made of: the [`Call`]s of a [`LaunchPlan`] (kernels, GEMMs, cuDNN
//! convolutions, copies and fills), the buffers they name ([`Buf`]) and the kernel arguments
//! ([`Arg`]) with their C layout.

use super::*;

/// A buffer as the plan names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buf {
    /// A byte offset in one of the program's regions.
    Tensor(Region, u64),
    /// A byte offset in the launch's workspace (scratch shared by all launches of a program).
    Work(u64),
    /// A byte offset in the launch's `aux` bytes, uploaded once.
    Aux(u64),
    /// The launch's error word (an i32 the device zeroes once and reads at each synchronisation):
    /// kernels that read indices from device memory store 1 there for one out of range.
    Flag,
}

impl Buf {
    /// The same buffer `bytes` further on.
    pub fn at(self, bytes: u64) -> Buf {
        match self {
            Buf::Tensor(r, o) => Buf::Tensor(r, o + bytes),
            Buf::Work(o) => Buf::Work(o + bytes),
            Buf::Aux(o) => Buf::Aux(o + bytes),
            Buf::Flag => Buf::Flag,
        }
    }
}

/// One kernel argument, passed by value as the kernel declares it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    Ptr(Buf),
    Null,
    I64(i64),
    I32(i32),
    F32(f32),
    F64(f64),
    U64(u64),
    /// `Dims8` or `Strides8` (common.cuh): 8 × i64.
    Dims([i64; 8]),
    /// `Window3` (common.cuh).
    Window(Window3),
    /// A struct of three `long long`s (attention.cu's `AttnStrides`).
    Longs3([i64; 3]),
    /// A struct of five `long long`s (attention.cu's `AttnShape`).
    Longs5([i64; 5]),
}

/// `struct Window3` of kernels/common.cuh, byte for byte.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Window3 {
    pub inp: [i64; 3],
    pub out: [i64; 3],
    pub k: [i64; 3],
    pub stride: [i64; 3],
    pub dil: [i64; 3],
    pub pad: [i64; 3],
    pub pad_end: [i64; 3],
    pub nsp: i32,
    pub unused: i32,
}

impl Window3 {
    fn bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(176);
        for a in [self.inp, self.out, self.k, self.stride, self.dil, self.pad, self.pad_end] {
            a.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        }
        out.extend_from_slice(&self.nsp.to_le_bytes());
        out.extend_from_slice(&self.unused.to_le_bytes());
        out
    }
}

impl Arg {
    /// Size and alignment in bytes, as C lays the parameter out.
    pub fn layout(&self) -> (usize, usize) {
        match self {
            Arg::I32(_) | Arg::F32(_) => (4, 4),
            Arg::Dims(_) => (64, 8),
            Arg::Window(_) => (176, 8),
            Arg::Longs3(_) => (24, 8),
            Arg::Longs5(_) => (40, 8),
            _ => (8, 8),
        }
    }

    /// The argument's bytes, with `ptr` resolving the buffers it names.
    pub fn bytes(&self, ptr: &dyn Fn(Buf) -> u64) -> Vec<u8> {
        match *self {
            Arg::Ptr(b) => ptr(b).to_le_bytes().to_vec(),
            Arg::Null => 0u64.to_le_bytes().to_vec(),
            Arg::I64(v) => v.to_le_bytes().to_vec(),
            Arg::I32(v) => v.to_le_bytes().to_vec(),
            Arg::F32(v) => v.to_le_bytes().to_vec(),
            Arg::F64(v) => v.to_le_bytes().to_vec(),
            Arg::U64(v) => v.to_le_bytes().to_vec(),
            Arg::Dims(d) => d.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Arg::Window(w) => w.bytes(),
            Arg::Longs3(v) => v.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Arg::Longs5(v) => v.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

/// The byte offset of each argument in a kernel's parameter buffer, and the buffer's size.
pub fn param_offsets(args: &[Arg]) -> (Vec<usize>, usize) {
    let mut offsets = Vec::with_capacity(args.len());
    let mut at = 0usize;
    for a in args {
        let (size, align) = a.layout();
        at = at.next_multiple_of(align);
        offsets.push(at);
        at += size;
    }
    (offsets, at)
}

/// Whether `args` are what `kernel` declares (its parameters' offsets and sizes, read from the
/// cubin by [`super::cubin`]).
pub fn check_args(name: &str, args: &[Arg], declared: &crate::cuda::cubin::KernelParams) -> Result<(), String> {
    let (offsets, total) = param_offsets(args);
    let got: Vec<(u32, u32)> = offsets.iter().zip(args).map(|(&o, a)| (o as u32, a.layout().0 as u32)).collect();
    let want: Vec<(u32, u32)> = declared.params.iter().map(|q| (q.offset, q.size)).collect();
    if got != want || total as u32 != declared.total {
        return Err(format!(
            "{name} takes (offset, size) {want:?} ({} bytes); the plan passes {got:?} ({total} bytes)",
            declared.total
        ));
    }
    Ok(())
}

/// One kernel launch.
#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    /// The family (`kernels/<family>.cu`) and the kernel's name in it.
    pub family: &'static str,
    pub name: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub args: Vec<Arg>,
    /// A fused chain's kernel (family `fused`): what it computes and its generated source.
    pub fused: Option<std::sync::Arc<fused::Fused>>,
}

/// A cuBLAS batched GEMM in cuBLAS's column-major terms: `C = alpha op(A) op(B) + beta C` for each
/// of `batch` matrices (strided, or by arrays of addresses), FP32 accumulation for f32/f16/bf16,
/// f64 for f64.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemm {
    /// The operands' dtype, and the result's (f32 for a low-precision product whose result is
    /// summed further before it is rounded).
    pub dtype: DType,
    pub c_dtype: DType,
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: i64,
    pub n: i64,
    pub k: i64,
    pub alpha: f64,
    pub beta: f64,
    pub a: Buf,
    pub lda: i64,
    pub stride_a: i64,
    pub b: Buf,
    pub ldb: i64,
    pub stride_b: i64,
    pub c: Buf,
    pub ldc: i64,
    pub stride_c: i64,
    pub batch: i64,
    /// Matrices that no single stride walks (a product written through a Transpose): three
    /// arrays in the launch's aux bytes of `batch` device addresses each, of A's, B's and C's
    /// matrices (`cublasGemmBatchedEx`). `a`, `b` and `c` are then the first matrices, and the
    /// strides unused.
    pub pointers: Option<[Buf; 3]>,
}

/// A product that cuBLASLt finishes as it writes it (its epilogue): `D = act(alpha op(A) op(B) +
/// bias)`, the bias one value per row of D in cuBLAS's column-major terms (per output feature of
/// a row-major `[rows, features]` result), the activation a ReLU or none. The sum is rounded once,
/// as a product with beta 1 over the broadcast bias rounds it; ReLU commutes with that rounding.
/// Or `D = alpha op(A) op(B)` where a ReLU's mask bit is set, else 0 (a ReLU's gradient).
#[derive(Clone, Debug, PartialEq)]
pub struct LtGemm {
    /// The product, with beta 0 and one matrix (batch 1).
    pub gemm: Gemm,
    /// `gemm.m` values of `gemm.c_dtype`.
    pub bias: Option<Buf>,
    pub relu: bool,
    /// The ReLU's gradient applied to D as it is written, from `mask` (cuBLASLt's `DRELU`): only
    /// with a mask, which the ReLU's own product wrote (the device checks it did).
    pub relu_grad: bool,
    /// A ReLU's signs as bits ([`crate::program::Launch::relu_mask`]): written with `relu`
    /// (`RELU_AUX`), read with `relu_grad`.
    pub mask: Option<LtMask>,
    /// The tanh GELU's gradient applied to D as it is written, from the GELU's input (cuBLASLt's
    /// `DGELU`): D's layout, `ld` elements a column.
    pub gelu_grad: Option<LtAux>,
    /// Where the bias gradient goes (with no bias and no ReLU), and of which operand: the sums
    /// over `k` of `op(A)`'s rows (`gemm.m` values) or of `op(B)`'s columns (`gemm.n`), of
    /// `gemm.c_dtype` (a dense layer's `db`, beside `dW`).
    pub bgrad: Option<(Buf, GradOf)>,
    /// The same as plain calls: the bias broadcast into D, a product with beta 1, a ReLU over D;
    /// or the product and the bias gradient's reduction.
    pub fallback: Vec<Call>,
}

/// A matrix an epilogue reads beside D, of D's dtype and layout (column-major, `ld` elements a
/// column, no less than `gemm.m`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LtAux {
    pub buf: Buf,
    pub ld: i64,
}

/// A ReLU bit-mask as cuBLASLt keeps it: bit `i + j ld` for D's element `(i, j)` (column-major),
/// `ld` a multiple of 128 no less than `gemm.m`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LtMask {
    pub buf: Buf,
    pub ld: i64,
}

/// The operand whose sums over `k` a bias gradient takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradOf {
    A,
    B,
}

/// A 2-D convolution (NCHW, symmetric pads) that a device with cuDNN runs as cuDNN calls, and
/// any other device as `fallback`: the im2col / GEMM / col2im calls that compute the same.
#[derive(Clone, Debug, PartialEq)]
pub struct DnnConv {
    /// The data type of every operand (f32, f16 or bf16; f32 arithmetic).
    pub dtype: DType,
    /// X (N, C, H, W), W (K, C / groups, R, S) and Y (N, K, P, Q).
    pub x: [i64; 4],
    pub w: [i64; 4],
    pub y: [i64; 4],
    pub pads: [i64; 2],
    pub strides: [i64; 2],
    pub dilations: [i64; 2],
    pub groups: i64,
    /// What to compute, in order; each overwrites its result.
    pub ops: Vec<DnnOp>,
    /// The same without cuDNN. Its scratch is in the launch's workspace, past that of the calls
    /// before it (the calls after it may take the same bytes once it has run). The plan's
    /// `workspace` leaves it out (a device that runs the convolution through cuDNN does not
    /// allocate the columns); `fallback_workspace` is the launch's scratch where it runs.
    pub fallback: Vec<Call>,
    pub fallback_workspace: u64,
}

impl DnnOp {
    /// Its two operands and its result, in cuDNN's argument order.
    pub fn buffers(&self) -> [Buf; 3] {
        match *self {
            DnnOp::Forward { x, w, y } => [x, w, y],
            DnnOp::BackwardData { w, dy, dx } => [w, dy, dx],
            DnnOp::BackwardFilter { x, dy, dw } => [x, dy, dw],
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DnnOp {
    /// Y = X ⋆ W.
    Forward { x: Buf, w: Buf, y: Buf },
    /// dX from dY and W (the transposed convolution).
    BackwardData { w: Buf, dy: Buf, dx: Buf },
    /// dW from X and dY.
    BackwardFilter { x: Buf, dy: Buf, dw: Buf },
}

#[derive(Clone, Debug, PartialEq)]
pub enum Call {
    Kernel(Kernel),
    Gemm(Gemm),
    /// A convolution for cuDNN, with what to run where there is none.
    Conv(Box<DnnConv>),
    /// A product with a bias and activation for cuBLASLt, with what to run where it is refused.
    Lt(Box<LtGemm>),
    /// A device-to-device copy.
    Copy {
        from: Buf,
        to: Buf,
        bytes: u64,
    },
    /// Every byte of the range set to `byte`.
    Fill {
        to: Buf,
        bytes: u64,
        byte: u8,
    },
}

/// Everything one launch enqueues.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LaunchPlan {
    pub calls: Vec<Call>,
    /// Scratch bytes the calls use (256-byte aligned pieces), leaving out the scratch of any
    /// convolution's fallback (see [`LaunchPlan::workspace_with_fallbacks`]).
    pub workspace: u64,
    /// Bytes to upload once; [`Buf::Aux`] offsets point into them.
    pub aux: Vec<u8>,
    /// Device addresses a kernel reads from `aux` (a multi-tensor launch's pointer array): the
    /// 8 bytes at each offset become the address of the buffer, once it is known.
    pub addresses: Vec<(u64, Buf)>,
}

impl LaunchPlan {
    /// The scratch bytes the calls use where every convolution runs as its fallback.
    pub fn workspace_with_fallbacks(&self) -> u64 {
        let convs = self.calls.iter().filter(|c| matches!(c, Call::Conv(_))).count();
        self.scratch_bytes(&vec![None; convs])
    }

    /// Where a library's own scratch starts in the launch's scratch: past the plan's.
    pub fn library_scratch_at(&self) -> u64 {
        self.workspace.next_multiple_of(256)
    }

    /// The scratch bytes the calls use where the convolutions (in order) run through cuDNN
    /// with `Some(bytes)` of scratch of its own, placed at [`Self::library_scratch_at`], or as
    /// their fallbacks (`None`).
    pub fn scratch_bytes(&self, convs: &[Option<u64>]) -> u64 {
        let fallbacks = self.calls.iter().filter_map(|c| match c {
            Call::Conv(conv) => Some(conv.fallback_workspace),
            _ => None,
        });
        fallbacks
            .zip(convs)
            .map(|(fallback, dnn)| dnn.map_or(fallback, |bytes| self.library_scratch_at() + bytes))
            .fold(self.workspace, u64::max)
    }

    /// Every kernel the plan may launch: its own, and those of its convolutions' fallbacks.
    pub fn kernels(&self) -> Vec<&Kernel> {
        fn walk<'a>(calls: &'a [Call], out: &mut Vec<&'a Kernel>) {
            for c in calls {
                match c {
                    Call::Kernel(k) => out.push(k),
                    Call::Conv(conv) => walk(&conv.fallback, out),
                    Call::Lt(lt) => walk(&lt.fallback, out),
                    _ => {}
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.calls, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_laid_out_as_c_does() {
        let args =
            [Arg::Ptr(Buf::Work(0)), Arg::I32(1), Arg::Dims([0; 8]), Arg::F32(1.0), Arg::Window(Window3::default())];
        let (offsets, total) = param_offsets(&args);
        assert_eq!(offsets, vec![0, 8, 16, 80, 88]);
        assert_eq!(total, 264);
        assert_eq!(Window3::default().bytes().len(), 176);
        assert_eq!(std::mem::size_of::<Window3>(), 176);
    }
}

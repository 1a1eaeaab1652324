//! Typed views of the CPU device's regions. Every kernel reads its operands where they lie,
//! through [`host_view`]: a [`HostTensor`] whose elements borrow the region's bytes. f32 matrix
//! products also write straight into their place ([`try_launch`]), with the same matrixmultiply
//! calls as the reference kernels in [`super::linalg`] (same inputs, same order, same bits).

use half::{bf16, f16};
use mpc_ir::{DType, Op};

use crate::device::{CpuMemory, Regions};
use crate::program::{Launch, Operand, Region, TensorRef};
use crate::value::{Data, Elems, HostTensor};

/// The regions' base pointers, taken once so that every view of a launch derives from them.
pub(crate) struct Bases {
    arena: *mut u8,
    state: *mut u8,
    constants: *mut u8,
}

impl Bases {
    pub(crate) fn of(regions: &mut Regions<CpuMemory>) -> Bases {
        Bases {
            arena: regions.arena.base_mut(),
            state: regions.state.base_mut(),
            constants: regions.constants.base_mut(),
        }
    }

    /// The address of `t`'s first byte.
    fn at(&self, t: &TensorRef) -> *mut u8 {
        let base = match t.region {
            Region::Arena => self.arena,
            Region::State => self.state,
            Region::Constants => self.constants,
        };
        base.wrapping_add(t.offset as usize)
    }
}

/// `t` as a host tensor whose elements are a view of its bytes where they lie; a copy where a
/// view cannot be taken (bools, whose bytes need not be 0 or 1; a place not aligned for its
/// element type; a big-endian machine).
///
/// # Safety
/// `t` lies inside its region, and nothing writes the regions while the tensor (or a borrow of
/// it) lives.
pub(crate) unsafe fn host_view(bases: &Bases, t: &TensorRef) -> HostTensor {
    let p = bases.at(t) as *const u8;
    let n = t.numel();
    macro_rules! view {
        ($ty:ty, $var:ident) => {
            if cfg!(target_endian = "little") && (p as usize) % std::mem::align_of::<$ty>() == 0 {
                // SAFETY: aligned (checked), inside its region and unwritten while the view lives
                // (the caller's contract); every bit pattern is a value of these number types,
                // and on a little-endian machine their in-memory bytes are the region's.
                return HostTensor {
                    shape: t.shape.clone(),
                    data: Data::$var(unsafe { Elems::view(p as *const $ty, n) }),
                };
            }
        };
    }
    match t.dtype {
        DType::F32 => view!(f32, F32),
        DType::F16 => view!(f16, F16),
        DType::BF16 => view!(bf16, BF16),
        DType::F64 => view!(f64, F64),
        DType::I64 => view!(i64, I64),
        DType::I32 => view!(i32, I32),
        DType::I16 => view!(i16, I16),
        DType::I8 => view!(i8, I8),
        DType::U64 => view!(u64, U64),
        DType::U32 => view!(u32, U32),
        DType::U16 => view!(u16, U16),
        DType::U8 => view!(u8, U8),
        DType::Bool => {}
    }
    // SAFETY: `t.bytes()` bytes at `p` lie inside the region and are initialised (regions are
    // allocated zeroed).
    let bytes = unsafe { std::slice::from_raw_parts(p, t.bytes() as usize) };
    HostTensor::from_le_bytes(t.dtype, t.shape.clone(), bytes)
}

fn f32_operand(o: Option<&Operand>) -> Option<&TensorRef> {
    match o {
        Some(Operand::Device(t) | Operand::Transposed(t)) if t.dtype == DType::F32 => Some(t),
        _ => None,
    }
}

fn transposed(o: Option<&Operand>) -> bool {
    matches!(o, Some(Operand::Transposed(_)))
}

fn overlaps(a: &TensorRef, b: &TensorRef) -> bool {
    a.region == b.region && a.offset < b.offset + b.bytes() && b.offset < a.offset + a.bytes()
}

/// Runs `l` in place when it is an f32 Gemm or MatMul whose output overlaps none of its operands
/// and whose shapes fit; `false` when not (the caller runs the reference kernel). The caller has
/// checked that every place lies inside its region.
pub(crate) fn try_launch(regions: &mut Regions<CpuMemory>, l: &Launch) -> bool {
    // An epilogue that moves elements (a Transpose) needs the product whole first.
    let moves = l.epilogue.as_ref().is_some_and(|e| !crate::plan::elementwise(e));
    if !matches!(l.op, Op::Gemm(_) | Op::MatMul) || moves {
        return false;
    }
    let Some(out) = l.outputs.first().filter(|t| t.dtype == DType::F32 && l.outputs.len() == 1) else {
        return false;
    };
    let (Some(a), Some(b)) = (f32_operand(l.inputs.first()), f32_operand(l.inputs.get(1))) else {
        return false;
    };
    let c = match l.inputs.get(2) {
        None | Some(Operand::Absent) => None,
        Some(o) => match f32_operand(Some(o)) {
            Some(t) => Some(t),
            None => return false,
        },
    };
    if [Some(a), Some(b), c].into_iter().flatten().any(|t| overlaps(t, out)) {
        return false;
    }
    let bases = Bases::of(regions);
    let aligned = |t: &TensorRef| (bases.at(t) as usize) % std::mem::align_of::<f32>() == 0;
    if !cfg!(target_endian = "little") || ![Some(a), Some(b), c, Some(out)].into_iter().flatten().all(aligned) {
        return false;
    }
    // SAFETY: every tensor lies inside its region (the caller checked); the output overlaps no
    // input (checked above); the f32 pointers are aligned (checked above); nothing else touches
    // the regions while the launch runs.
    let slice = |t: &TensorRef| unsafe { std::slice::from_raw_parts(bases.at(t) as *const f32, t.numel()) };
    // SAFETY: as above; `out` is the only mutable view and overlaps none of the others.
    let out_slice = unsafe { std::slice::from_raw_parts_mut(bases.at(out) as *mut f32, out.numel()) };
    match &l.op {
        Op::Gemm(_) if transposed(l.inputs.first()) || transposed(l.inputs.get(1)) => false,
        Op::Gemm(g) => {
            if a.shape.len() != 2 || b.shape.len() != 2 {
                return false;
            }
            let (m, k) = if g.transA { (a.shape[1], a.shape[0]) } else { (a.shape[0], a.shape[1]) };
            let (k2, n) = if g.transB { (b.shape[1], b.shape[0]) } else { (b.shape[0], b.shape[1]) };
            if k != k2 || out.shape != [m, n] {
                return false;
            }
            super::linalg::gemm_f32_into(
                out_slice,
                slice(a),
                slice(b),
                c.map(|c| (slice(c), c.shape.as_slice())),
                (m, k, n),
                (g.transA, g.transB),
                (g.alpha, g.beta),
            );
            true
        }
        Op::MatMul if a.shape.len() >= 2 && b.shape.len() >= 2 && c.is_none() => {
            let (ta, tb) = (transposed(l.inputs.first()), transposed(l.inputs.get(1)));
            super::linalg::matmul_f32_into(out_slice, &out.shape, (slice(a), &a.shape, ta), (slice(b), &b.shape, tb))
        }
        _ => false,
    }
}

//! Launches the CPU device runs on its regions in place: f32 matrix products read their operands
//! where they lie and write the result straight into its place, with the same matrixmultiply
//! calls as the reference kernels in [`super::linalg`] (same inputs, same order, same bits). Every
//! other launch goes through the reference kernels on copies.

use mpc_ir::{DType, Op};

use crate::device::{CpuMemory, Regions};
use crate::program::{Launch, Operand, Region, TensorRef};

/// The regions' base pointers, taken once so that every slice below derives from them.
struct Bases {
    arena: *mut u8,
    state: *mut u8,
    constants: *mut u8,
}

impl Bases {
    fn of(t: &TensorRef, b: &Bases) -> *mut u8 {
        match t.region {
            Region::Arena => b.arena,
            Region::State => b.state,
            Region::Constants => b.constants,
        }
    }
}

fn f32_operand(o: Option<&Operand>) -> Option<&TensorRef> {
    match o {
        Some(Operand::Device(t)) if t.dtype == DType::F32 => Some(t),
        _ => None,
    }
}

fn overlaps(a: &TensorRef, b: &TensorRef) -> bool {
    a.region == b.region && a.offset < b.offset + b.bytes() && b.offset < a.offset + a.bytes()
}

/// Whether `l` is a launch [`try_launch`] may run: an f32 Gemm or MatMul whose output overlaps
/// none of its operands.
pub(crate) fn fits(l: &Launch) -> bool {
    matches!(l.op, Op::Gemm(_) | Op::MatMul)
        && l.outputs.len() == 1
        && l.outputs[0].dtype == DType::F32
        && f32_operand(l.inputs.first()).is_some()
        && f32_operand(l.inputs.get(1)).is_some()
        && l.inputs.iter().all(|o| !matches!(o, Operand::Device(t) if overlaps(t, &l.outputs[0])))
}

/// Runs `l` in place when it is an f32 Gemm or MatMul whose shapes fit; `false` when not (the
/// caller runs the reference kernel). An operand is read from `decoded` when a tensor stands for
/// it, else from its bytes, which the caller has written.
pub(crate) fn try_launch<'a>(
    regions: &mut Regions<CpuMemory>,
    l: &Launch,
    decoded: &dyn Fn(&TensorRef) -> Option<&'a [f32]>,
) -> bool {
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
    let bases = Bases {
        arena: regions.arena.base_mut(),
        state: regions.state.base_mut(),
        constants: regions.constants.base_mut(),
    };
    // SAFETY: every tensor lies inside its region (lowering placed it there and the device checks
    // each place it reads); the output overlaps no input (checked above); offsets are multiples
    // of 64 in 64-byte aligned regions, so the f32 pointers are aligned; nothing else touches
    // the regions while the launch runs.
    let slice = |t: &TensorRef| match decoded(t) {
        Some(v) => v,
        None => unsafe {
            std::slice::from_raw_parts(Bases::of(t, &bases).add(t.offset as usize) as *const f32, t.numel())
        },
    };
    // SAFETY: as above; `out` is the only mutable view and overlaps none of the others.
    let out_slice = unsafe {
        std::slice::from_raw_parts_mut(Bases::of(out, &bases).add(out.offset as usize) as *mut f32, out.numel())
    };
    match &l.op {
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
            super::linalg::matmul_f32_into(out_slice, &out.shape, slice(a), &a.shape, slice(b), &b.shape)
        }
        _ => false,
    }
}

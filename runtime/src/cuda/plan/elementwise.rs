//! Plans of element-wise ops: unary and binary float and integer ops (broadcasting), variadic
//! Sum/Max/Min/Mean, comparisons and logic, Where, Clip, IsNaN/IsInf, Cast, Identity, Dropout.

use super::*;

/// Plans `p`'s launch when its op is element-wise; `false` when it is not.
pub(super) fn plan_elementwise(p: &mut Planner) -> Result<bool, String> {
    let op = &p.l.op;
    if let Some((u, name, params)) = unary_name(op) {
        plan_unary(p, op, u, name, params)?;
        return Ok(true);
    }
    match op {
        Op::Identity => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            p.copy(buf(x), buf(y), y.bytes());
        }
        Op::Dropout(_) => {
            if p.host_ints(2).is_some_and(|v| v.first() == Some(&1)) {
                return Err("Dropout in training mode".into());
            }
            let (x, y) = (p.input(0)?, p.output(0)?);
            p.copy(buf(x), buf(y), y.bytes());
            if let Some(mask) = p.l.outputs.get(1) {
                p.out.calls.push(Call::Fill { to: buf(mask), bytes: mask.bytes(), byte: 1 });
            }
        }
        mpc_ir::arith_ops!() => plan_arith(p, op)?,
        Op::Sum | Op::Max | Op::Min | Op::Mean => plan_variadic(p, op)?,
        mpc_ir::compare_ops!() => {
            let (a, b, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
            if a.dtype != b.dtype {
                return Err(format!("{} of {} and {}", op.op_type(), a.dtype, b.dtype));
            }
            let name = binary_name(op).expect("a comparison");
            p.binary(name, tag(a.dtype)?, (buf(a), &a.shape), (buf(b), &b.shape), buf(y), &y.shape)?;
        }
        mpc_ir::bitwise_ops!() => plan_bitwise(p, op)?,
        Op::Not => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            let n = x.numel() as u64;
            p.flat(
                "elementwise",
                "elementwise_not_u8".into(),
                n,
                vec![Arg::Ptr(buf(x)), Arg::Ptr(buf(y)), Arg::I64(n as i64)],
            );
        }
        Op::Where => plan_where(p)?,
        Op::Clip => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            let n = x.numel() as u64;
            let bound = |i: usize| p.opt_input(i).map_or(Arg::Null, |t| Arg::Ptr(buf(t)));
            let (lo, hi) = (bound(1), bound(2));
            let args = vec![Arg::Ptr(buf(x)), Arg::Ptr(buf(y)), Arg::I64(n as i64), lo, hi];
            p.flat("elementwise", format!("elementwise_clip_{}", tag(x.dtype)?), n, args);
        }
        Op::IsNaN | Op::IsInf(_) => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            let n = x.numel() as u64;
            let t = float_tag(x.dtype)?;
            let mut args = vec![Arg::Ptr(buf(x)), Arg::Ptr(buf(y)), Arg::I64(n as i64)];
            let name = if let Op::IsInf(a) = op {
                args.extend([Arg::I32(a.detect_positive as i32), Arg::I32(a.detect_negative as i32)]);
                "isinf"
            } else {
                "isnan"
            };
            p.flat("elementwise", format!("elementwise_{name}_{t}"), n, args);
        }
        Op::Cast(_) => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            p.cast(x.dtype, y.dtype, buf(x), buf(y), x.numel() as u64)?;
        }
        _ => return Ok(false),
    }
    Ok(true)
}

/// A binary arithmetic op, broadcasting; Pow's exponent is cast to the base's dtype.
fn plan_arith(p: &mut Planner, op: &Op) -> Result<(), String> {
    let (a, b, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
    let name = binary_name(op).expect("a binary op");
    let t = if a.dtype.is_float() { float_tag(a.dtype)? } else { tag(a.dtype)? };
    let mut bb = buf(b);
    if b.dtype != a.dtype {
        // Pow's exponent takes the base's dtype first.
        if !matches!(op, Op::Pow) {
            return Err(format!("{} of {} and {}", op.op_type(), a.dtype, b.dtype));
        }
        let w = p.work(b.numel() as u64 * a.dtype.size() as u64);
        p.cast(b.dtype, a.dtype, bb, w, b.numel() as u64)?;
        bb = w;
    }
    p.binary(name, t, (buf(a), &a.shape), (bb, &b.shape), buf(y), &y.shape)?;
    Ok(())
}

/// A bit operation: unary (Not-like) or binary, broadcasting.
fn plan_bitwise(p: &mut Planner, op: &Op) -> Result<(), String> {
    let bits = op.bitwise().expect("a bit operation");
    let (a, y) = (p.input(0)?, p.output(0)?);
    if !bits.accepts(a.dtype) {
        return Err(format!("{} on {}", op.op_type(), a.dtype));
    }
    if bits.unary() {
        let n = a.numel() as u64;
        let args = vec![Arg::Ptr(buf(a)), Arg::Ptr(buf(y)), Arg::I64(n as i64)];
        p.flat("elementwise", format!("elementwise_{}_{}", bits.name(), tag(a.dtype)?), n, args);
    } else {
        let b = p.input(1)?;
        if b.dtype != a.dtype {
            return Err(format!("{} of {} and {}", op.op_type(), a.dtype, b.dtype));
        }
        p.binary(bits.name(), tag(a.dtype)?, (buf(a), &a.shape), (buf(b), &b.shape), buf(y), &y.shape)?;
    }
    Ok(())
}

/// A unary op: its float kernel, or its integer one where it computes on integers.
fn plan_unary(
    p: &mut Planner,
    op: &Op,
    u: Option<mpc_ir::ops::Unary>,
    name: &str,
    [alpha, beta]: [f32; 2],
) -> Result<(), String> {
    let (x, y) = (p.input(0)?, p.output(0)?);
    let n = x.numel() as u64;
    let integer = u.and_then(mpc_ir::ops::Unary::on_integers) == Some(mpc_ir::ops::IntegerUnary::Computes);
    if x.dtype.is_float() {
        let args = vec![Arg::Ptr(buf(x)), Arg::Ptr(buf(y)), Arg::I64(n as i64), Arg::F32(alpha), Arg::F32(beta)];
        p.flat("elementwise", format!("elementwise_{name}_{}", float_tag(x.dtype)?), n, args);
    } else if integer && matches!(x.dtype, DType::I64 | DType::I32) {
        let args = vec![Arg::Ptr(buf(x)), Arg::Ptr(buf(y)), Arg::I64(n as i64)];
        p.flat("elementwise", format!("elementwise_{name}_{}", tag(x.dtype)?), n, args);
    } else {
        return Err(format!("{} on {}", op.op_type(), x.dtype));
    }
    Ok(())
}

/// Sum, Max, Min and Mean of any number of inputs, left to right as the CPU reference.
fn plan_variadic(p: &mut Planner, op: &Op) -> Result<(), String> {
    let y = p.output(0)?;
    let ins: Vec<&TensorRef> = (0..p.l.inputs.len()).map(|i| p.input(i)).collect::<Result<_, _>>()?;
    let name = binary_name(op).expect("a variadic op");
    let t = if y.dtype.is_float() { float_tag(y.dtype)? } else { tag(y.dtype)? };
    let mean = matches!(op, Op::Mean);
    if ins.len() == 1 && !mean {
        p.copy(buf(ins[0]), buf(y), y.bytes());
        return Ok(());
    }
    // Left to right, as the CPU reference: each partial result in its own broadcast shape.
    let (mut acc, mut shape) = (buf(ins[0]), ins[0].shape.clone());
    for (i, x) in ins.iter().enumerate().skip(1) {
        let out = mpc_ir::geometry::broadcast_shape(&[&shape, &x.shape]).ok_or("inputs do not broadcast")?;
        let last = i == ins.len() - 1 && !mean;
        let dst = if last { buf(y) } else { p.work(numel(&out) * y.dtype.size() as u64) };
        p.binary(name, t, (acc, &shape), (buf(x), &x.shape), dst, &out)?;
        (acc, shape) = (dst, out);
    }
    if mean {
        let n = p.aux(&scalar_bytes(y.dtype, ins.len() as f64));
        p.binary("div", t, (acc, &shape), (n, &[]), buf(y), &y.shape)?;
    }
    Ok(())
}

/// Where, broadcasting its three operands.
fn plan_where(p: &mut Planner) -> Result<(), String> {
    let (c, a, b, y) = (p.input(0)?, p.input(1)?, p.input(2)?, p.output(0)?);
    let n = y.numel() as u64;
    let out = &y.shape;
    let same = c.shape == *out && a.shape == *out && b.shape == *out;
    let st = |s: &[usize]| us(&broadcast_strides(s, out));
    let (rank, dims, [sc, sa, sb]) =
        if same { (0, [0; 8], [[0; 8]; 3]) } else { strided_args(out, [&st(&c.shape), &st(&a.shape), &st(&b.shape)])? };
    let args = vec![
        Arg::Ptr(buf(c)),
        Arg::Ptr(buf(a)),
        Arg::Ptr(buf(b)),
        Arg::Ptr(buf(y)),
        Arg::I64(n as i64),
        Arg::I32(rank),
        Arg::Dims(dims),
        Arg::Dims(sc),
        Arg::Dims(sa),
        Arg::Dims(sb),
    ];
    p.flat("elementwise", format!("elementwise_where_{}", size_tag(y.dtype)?), n, args);
    Ok(())
}

/// The unary kernel of `op` (its [`mpc_ir::ops::Unary`], where it is one), its name and its
/// parameters; onnxruntime's `com.microsoft::Gelu` is the erf form's kernel.
pub(super) fn unary_name(op: &Op) -> Option<(Option<mpc_ir::ops::Unary>, &'static str, [f32; 2])> {
    match op {
        Op::Opaque(o) if o.domain == "com.microsoft" && o.op_type == "Gelu" => Some((None, "gelu", [0.0, 0.0])),
        op => op.unary().map(|(u, params)| (Some(u), u.name(), params)),
    }
}

pub(super) fn binary_name(op: &Op) -> Option<&'static str> {
    if let Some(a) = op.arith() {
        return Some(a.name());
    }
    if let Some(c) = op.compare() {
        return Some(c.name());
    }
    Some(match op {
        Op::Sum | Op::Mean => "add",
        Op::Min => "min",
        Op::Max => "max",
        // In fused chains only (its own launches are train.cu's kernel, which computes the same).
        Op::ReluGrad => "relu_grad",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use mpc_ir::ops::{Trig, Unary};

    /// Every op of `Unary` has its formula in kernels/common.cuh's list (`X(name, ...)` in
    /// `MPC_UNARY_OPS`), which kernels/elementwise.cu expands into its kernels, and every op of
    /// that list is one of `Unary`'s; every op of `Trig` plans its kernel by its name.
    #[test]
    fn every_unary_op_names_a_kernel_the_source_defines() {
        let (_, source) = crate::cuda::nvrtc::FAMILIES.iter().find(|(f, _)| *f == "elementwise").unwrap();
        let common = crate::cuda::nvrtc::COMMON;
        assert!(source.contains("MPC_UNARY_OPS(UNARY_OF)"), "elementwise.cu does not expand the unary list");
        let list = common.split("#define MPC_UNARY_OPS(X)").nth(1).expect("common.cuh's unary list");
        let listed: Vec<&str> = list
            .lines()
            .skip(1)
            .map_while(|l| l.trim().strip_prefix("X("))
            .map(|l| l.split(',').next().unwrap())
            .collect();
        let names: Vec<&str> = Unary::all().map(Unary::name).collect();
        for name in &names {
            assert!(listed.contains(name), "{name}: not in common.cuh's MPC_UNARY_OPS");
        }
        for name in &listed {
            assert!(names.contains(name), "common.cuh's X({name}, ...) is no op of Unary");
        }
        for t in Trig::ALL {
            let op = mpc_ir::Op::from_attrs(&format!("{t:?}"), vec![]).unwrap().unwrap();
            assert_eq!(super::unary_name(&op).map(|u| u.1), Some(t.name()), "{t:?}");
        }
    }

    /// Every op of `Arith` names a functor kernels/common.cuh defines (`VOP(name, ...)`), and every
    /// op of `Compare` a kernel of kernels/elementwise.cu (`CMP(name)`, or the bool kernel
    /// `elementwise_<name>_u8`).
    #[test]
    fn every_binary_op_names_a_kernel_the_source_defines() {
        use mpc_ir::ops::{Arith, Compare};
        let (_, source) = crate::cuda::nvrtc::FAMILIES.iter().find(|(f, _)| *f == "elementwise").unwrap();
        let common = crate::cuda::nvrtc::COMMON;
        let arith = [Arith::Add, Arith::Sub, Arith::Mul, Arith::Div, Arith::Pow, Arith::PRelu];
        for a in arith.into_iter().chain([Arith::Mod { fmod: true }, Arith::Mod { fmod: false }]) {
            assert!(common.contains(&format!("VOP({},", a.name())), "{a:?}: no VOP in common.cuh");
        }
        let compare = [
            Compare::Equal,
            Compare::Less,
            Compare::Greater,
            Compare::GreaterOrEqual,
            Compare::LessOrEqual,
            Compare::And,
            Compare::Or,
            Compare::Xor,
        ];
        for c in compare {
            let (cmp, logic) = (format!("CMP({})", c.name()), format!("elementwise_{}_u8", c.name()));
            assert!(source.contains(&cmp) || source.contains(&logic), "{c:?}: no kernel in elementwise.cu");
        }
    }

    /// Every op of `Bitwise` names a kernel that kernels/elementwise.cu defines.
    #[test]
    fn every_bitwise_op_names_a_kernel_the_source_defines() {
        let (_, source) = crate::cuda::nvrtc::FAMILIES.iter().find(|(f, _)| *f == "elementwise").unwrap();
        for b in mpc_ir::ops::Bitwise::ALL {
            let defined = if b.unary() { format!("elementwise_{}_", b.name()) } else { format!("IBOP({},", b.name()) };
            assert!(source.contains(&defined), "{b:?}: `{defined}` is not in elementwise.cu");
            let instantiated = [format!("WBINARY({})", b.name()), format!("SHIFT({})", b.name())];
            assert!(b.unary() || instantiated.iter().any(|i| source.contains(i)), "{b:?}: no kernels");
        }
    }
}

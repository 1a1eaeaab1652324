//! What the libraries compute for a plan's calls: cuBLAS GEMMs in column-major terms (strided or
//! by arrays of addresses), cuBLASLt's products with their epilogues, and convolutions as cuDNN
//! computes them, by the CPU's ops.

use mpc_runtime::cpu::run_op;
use mpc_runtime::cuda::plan::{Buf, DnnConv, DnnOp, Gemm, GradOf, LtGemm, LtMask};
use mpc_runtime::HostTensor;

use super::interp::Memory;

pub(crate) fn run_gemm(m: &mut Memory, g: &Gemm) {
    gemm_then(m, g, &mut |_, _, v| v);
}

/// A GEMM whose every result (before it is rounded to C's dtype) goes through `finish(row,
/// column, value)` (cuBLAS's column-major rows and columns).
fn gemm_then(m: &mut Memory, g: &Gemm, finish: &mut dyn FnMut(i64, i64, f64) -> f64) {
    let (d, dc) = (g.dtype, g.c_dtype);
    for bi in 0..g.batch {
        // Each matrix where its stride or its entry in the arrays of addresses says.
        let (ga, gb, gc, a0, b0, c0) = match g.pointers {
            Some(arrays) => {
                let [pa, pb, pc] = arrays.map(|p| {
                    let Buf::Aux(at) = p else { panic!("an array of addresses outside the aux bytes") };
                    m.addresses[&(at + 8 * bi as u64)]
                });
                (pa, pb, pc, 0, 0, 0)
            }
            None => (g.a, g.b, g.c, bi * g.stride_a, bi * g.stride_b, bi * g.stride_c),
        };
        let g = &Gemm { a: ga, b: gb, c: gc, ..g.clone() };
        for i in 0..g.m {
            for j in 0..g.n {
                let mut s = 0.0;
                for l in 0..g.k {
                    let av =
                        if g.trans_a { m.get(g.a, a0 + l + i * g.lda, d) } else { m.get(g.a, a0 + i + l * g.lda, d) };
                    let bv =
                        if g.trans_b { m.get(g.b, b0 + j + l * g.ldb, d) } else { m.get(g.b, b0 + l + j * g.ldb, d) };
                    s += av * bv;
                }
                let at = c0 + i + j * g.ldc;
                let old = if g.beta != 0.0 { m.get(g.c, at, dc) } else { 0.0 };
                let v = finish(i, j, g.alpha * s + g.beta * old);
                m.set(g.c, at, dc, v);
            }
        }
    }
}

/// The tanh GELU's slope at `x`: the CPU's GeluGrad of a gradient of 1.
fn gelu_tanh_slope(x: f64) -> f64 {
    let op = mpc_ir::Op::GeluGrad(Box::new(mpc_ir::ops::GeluAttrs { approximate: mpc_ir::ops::GeluApprox::Tanh }));
    let t = |v: f64| HostTensor::from_f64(mpc_ir::DType::F64, vec![1], vec![v]);
    run_op(&op, &[Some(&t(1.0)), Some(&t(x))], 1).unwrap()[0].f64s()[0]
}

/// What cuBLASLt computes for `lt`: the product, plus the bias of its row, through the ReLU
/// (its signs written as bits to the mask), kept where the mask's bit is set, or times the GELU's
/// slope at its input, rounded once; and the bias gradient.
pub(crate) fn run_lt(m: &mut Memory, lt: &LtGemm) {
    let bias: Vec<f64> = match lt.bias {
        Some(b) => (0..lt.gemm.m).map(|i| m.get(b, i, lt.gemm.c_dtype)).collect(),
        None => vec![0.0; lt.gemm.m as usize],
    };
    // The mask as bits: read before the product (a gradient's), written after it (a ReLU's).
    let bits = |m: &mut Memory, mask: &LtMask| -> Vec<u8> {
        let len = (mask.ld * lt.gemm.n / 8) as usize;
        m.bytes(mask.buf, 0, len)
    };
    let read = match (lt.relu_grad, &lt.mask) {
        (true, Some(mask)) => bits(m, mask),
        (true, None) => panic!("a ReLU's gradient without its mask"),
        _ => Vec::new(),
    };
    // The GELU's input, read before the product (D may be where it lies only if the plan is
    // wrong; the check would then fail).
    let gelu_input: Vec<f64> = match lt.gelu_grad {
        Some(h) => (0..lt.gemm.n)
            .flat_map(|col| (0..lt.gemm.m).map(move |row| row + col * h.ld))
            .map(|at| m.get(h.buf, at, lt.gemm.c_dtype))
            .collect(),
        None => Vec::new(),
    };
    let mut signs = Vec::new();
    gemm_then(m, &lt.gemm, &mut |row, col, v| {
        if lt.gelu_grad.is_some() {
            return v * gelu_tanh_slope(gelu_input[(row + col * lt.gemm.m) as usize]);
        }
        let v = v + bias[row as usize];
        let bit = lt.mask.map(|mask| (row + col * mask.ld) as usize);
        if lt.relu_grad {
            let bit = bit.expect("a mask");
            if read[bit / 8] >> (bit % 8) & 1 == 1 {
                v
            } else {
                0.0
            }
        } else if lt.relu {
            if let Some(bit) = bit {
                signs.push((bit, v > 0.0));
            }
            v.max(0.0)
        } else {
            v
        }
    });
    if let (Some(mask), false) = (lt.mask, signs.is_empty()) {
        let mut bytes = bits(m, &mask);
        for (bit, set) in signs {
            let (byte, b) = (bit / 8, 1u8 << (bit % 8));
            bytes[byte] = if set { bytes[byte] | b } else { bytes[byte] & !b };
        }
        m.put(mask.buf, 0, &bytes);
    }
    // The bias gradient: the sums over k of op(A)'s rows or op(B)'s columns, rounded once. Element
    // (r, c) of op(X) is X's (c, r) where X is read transposed.
    let Some((db, of)) = lt.bgrad else { return };
    let g = &lt.gemm;
    let at = |trans: bool, ld: i64, r: i64, c: i64| if trans { c + r * ld } else { r + c * ld };
    let (x, len, of): (Buf, i64, &dyn Fn(i64, i64) -> i64) = match of {
        GradOf::A => (g.a, g.m, &|i, l| at(g.trans_a, g.lda, i, l)),
        GradOf::B => (g.b, g.n, &|j, l| at(g.trans_b, g.ldb, l, j)),
    };
    for i in 0..len {
        let s: f64 = (0..g.k).map(|l| m.get(x, of(i, l), g.dtype)).sum();
        m.set(db, i, g.c_dtype, s);
    }
}

/// What cuDNN computes for `conv`, by the CPU's Conv and ConvGrad on the operands the
/// descriptors describe: the plan's shapes, pads, strides, dilations and groups.
pub(crate) fn run_dnn(m: &mut Memory, conv: &DnnConv) {
    use mpc_ir::ops::ConvAttrs;
    use mpc_ir::Op;
    let d = conv.dtype;
    let shape = |s: [i64; 4]| s.iter().map(|&v| v as usize).collect::<Vec<_>>();
    let numel = |s: [i64; 4]| s.iter().product::<i64>() as usize;
    let mut read = |b: Buf, s: [i64; 4]| HostTensor::from_le_bytes(d, shape(s), &m.bytes(b, 0, numel(s) * d.size()));
    let zeros = |s: [i64; 4]| HostTensor::from_f64(d, shape(s), vec![0.0; numel(s)]);
    let attrs = ConvAttrs {
        pads: vec![conv.pads[0], conv.pads[1], conv.pads[0], conv.pads[1]],
        strides: conv.strides.to_vec(),
        dilations: conv.dilations.to_vec(),
        group: conv.groups,
        kernel_shape: conv.w[2..].to_vec(),
        ..ConvAttrs::default()
    };
    let mut results = Vec::new();
    for op in &conv.ops {
        let (out, t) = match *op {
            DnnOp::Forward { x, w, y } => {
                let (x, w) = (read(x, conv.x), read(w, conv.w));
                (y, run_op(&Op::Conv(Box::new(attrs.clone())), &[Some(&x), Some(&w)], 1).unwrap().remove(0))
            }
            DnnOp::BackwardData { w, dy, dx } => {
                let (w, dy, x) = (read(w, conv.w), read(dy, conv.y), zeros(conv.x));
                (
                    dx,
                    run_op(&Op::ConvGrad(Box::new(attrs.clone())), &[Some(&dy), Some(&x), Some(&w)], 2)
                        .unwrap()
                        .remove(0),
                )
            }
            DnnOp::BackwardFilter { x, dy, dw } => {
                let (x, dy, w) = (read(x, conv.x), read(dy, conv.y), zeros(conv.w));
                (
                    dw,
                    run_op(&Op::ConvGrad(Box::new(attrs.clone())), &[Some(&dy), Some(&x), Some(&w)], 2)
                        .unwrap()
                        .remove(1),
                )
            }
        };
        results.push((out, t));
    }
    // Every operation reads the operands as they were before any of them wrote.
    for (out, t) in results {
        let mut b = vec![0u8; t.bytes()];
        t.write_le_bytes(&mut b);
        m.put(out, 0, &b);
    }
}

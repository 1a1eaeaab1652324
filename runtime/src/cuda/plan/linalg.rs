//! Plans of matrix products (MatMul, Gemm with its cuBLASLt epilogues) and Einsum.

use super::*;

pub(super) fn plan_matmul(p: &mut Planner) -> Result<(), String> {
    if let Some(Op::Transpose(t)) = &p.l.epilogue {
        let perm: Vec<usize> = t.perm.iter().flatten().map(|&d| d as usize).collect();
        return plan_matmul_strided(p, Some(&perm));
    }
    if p.l.inputs.iter().any(|o| matches!(o, Operand::Permuted(..))) {
        return plan_matmul_strided(p, None);
    }
    let ((a, ta), (b, tb), y) = (p.input_or_transposed(0)?, p.input_or_transposed(1)?, p.output(0)?);
    // 1-D operands: a row vector on the left, a column vector on the right. A transposed operand
    // (rank 2 or more) is stored with its last two axes swapped: `sa` and `sb` are the stored shapes.
    let sa: Vec<usize> = if a.shape.len() == 1 { vec![1, a.shape[0]] } else { a.shape.clone() };
    let sb: Vec<usize> = if b.shape.len() == 1 { vec![b.shape[0], 1] } else { b.shape.clone() };
    let (ra, rb) = (sa.len(), sb.len());
    let (m, k) = if ta { (sa[ra - 1], sa[ra - 2]) } else { (sa[ra - 2], sa[ra - 1]) };
    let (k2, n) = if tb { (sb[rb - 1], sb[rb - 2]) } else { (sb[rb - 2], sb[rb - 1]) };
    if k2 != k {
        return Err("MatMul operands whose inner dims differ".into());
    }
    let batch_shape =
        mpc_ir::geometry::broadcast_shape(&[&sa[..ra - 2], &sb[..rb - 2]]).ok_or("batch dims do not broadcast")?;
    let batch = numel(&batch_shape);
    let (pa, stride_a) = batched_operand(p, a, &sa, &batch_shape)?;
    let (pb, stride_b) = batched_operand(p, b, &sb, &batch_shape)?;
    // Batched rows against one matrix (a Linear on a sequence: [batch, tokens, features] times a
    // weight) are one product of all the rows: `m` grows instead of the batch count.
    let (m, batch) =
        if stride_b == 0 && !ta && stride_a == (m * k) as i64 { (m * batch as usize, 1) } else { (m, batch) };
    // A bias the product adds as it writes (its Add epilogue): one value per output feature.
    let bias = match (&p.l.epilogue, &p.l.epilogue_operand) {
        (None, None) => None,
        (Some(Op::Add), Some(Operand::Device(c))) if batch == 1 && c.numel() == n && c.dtype == y.dtype => {
            Some(c.clone())
        }
        _ => return Err("a MatMul epilogue other than a bias over one product's rows".into()),
    };
    let start = p.out.calls.len();
    if let Some(c) = &bias {
        // The plain calls: the bias broadcast into Y, which the product adds (beta 1).
        p.expand(y.dtype, buf(c), &c.shape, buf(y), &y.shape)?;
    }
    // Row-major Y = A B is column-major Yᵀ = Bᵀ Aᵀ. A row-major matrix is its transpose in
    // column-major order, so an operand stored transposed is read with the transpose flag, its
    // leading dim its stored row length.
    let gemm = Gemm {
        dtype: y.dtype,
        c_dtype: y.dtype,
        trans_a: tb,
        trans_b: ta,
        m: n as i64,
        n: m as i64,
        k: k as i64,
        alpha: 1.0,
        beta: if bias.is_some() { 1.0 } else { 0.0 },
        a: pb,
        lda: if tb { k } else { n } as i64,
        stride_a: stride_b,
        b: pa,
        ldb: if ta { m } else { k } as i64,
        stride_b: stride_a,
        c: buf(y),
        ldc: n as i64,
        stride_c: (m * n) as i64,
        batch: batch as i64,
        pointers: None,
    };
    if k == 0 {
        // An empty inner dim: the product is zeros (and the bias, broadcast above).
        if bias.is_none() {
            p.out.calls.push(Call::Fill { to: buf(y), bytes: y.bytes(), byte: 0 });
        }
        return Ok(());
    }
    p.gemm(gemm.clone());
    if let Some(c) = bias.filter(|_| matches!(y.dtype, DType::F32 | DType::F16 | DType::BF16) && m * n > 0) {
        bias_epilogue(p, start, gemm, &c);
    }
    Ok(())
}

/// A MatMul operand's buffer and batch stride: its own when its batch dims are the output's
/// (`batch_shape`), 0 when it has one matrix, else it is expanded to the output's batch dims
/// first. `s` is the operand's stored shape.
fn batched_operand(p: &mut Planner, t: &TensorRef, s: &[usize], batch_shape: &[usize]) -> Result<(Buf, i64), String> {
    let own = &s[..s.len() - 2];
    let mat = numel(&s[s.len() - 2..]) as i64;
    if numel(own) == 1 {
        Ok((buf(t), 0))
    } else if own == batch_shape {
        Ok((buf(t), mat))
    } else {
        let mut full = batch_shape.to_vec();
        full.extend_from_slice(&s[s.len() - 2..]);
        let w = p.work(numel(&full) * t.dtype.size() as u64);
        p.expand(t.dtype, buf(t), s, w, &full)?;
        Ok((w, mat))
    }
}

/// cuBLASLt adds the bias `c` as it writes the product: one pass over Y instead of three. The
/// plain calls from `start` (the bias broadcast, then the product) become its fallback.
fn bias_epilogue(p: &mut Planner, start: usize, gemm: Gemm, c: &TensorRef) {
    let fallback = p.out.calls.split_off(start);
    let gemm = Gemm { beta: 0.0, ..gemm };
    p.out.calls.push(Call::Lt(Box::new(LtGemm {
        gemm,
        bias: Some(buf(c)),
        relu: false,
        relu_grad: false,
        mask: None,
        gelu_grad: None,
        bgrad: None,
        fallback,
    })));
}

/// A matrix, or a batch of them, where it lies: the tensor, the shape the product sees and each
/// of those axes' stride in elements.
struct Strided<'a> {
    t: &'a TensorRef,
    shape: Vec<usize>,
    strides: Vec<i64>,
}

impl<'a> Strided<'a> {
    /// An operand as the launch reads it: as stored, with its last two axes swapped, or through
    /// a permutation of its axes.
    fn operand(o: &'a Operand) -> Result<Strided<'a>, String> {
        let (t, perm): (&TensorRef, Vec<usize>) = match o {
            Operand::Device(t) => (t, (0..t.shape.len()).collect()),
            Operand::Transposed(t) => {
                let r = t.shape.len();
                (
                    t,
                    (0..r)
                        .map(|i| {
                            if i + 2 == r {
                                r - 1
                            } else if i + 1 == r {
                                r - 2
                            } else {
                                i
                            }
                        })
                        .collect(),
                )
            }
            Operand::Permuted(t, perm) => (t, perm.clone()),
            _ => return Err("a MatMul operand that is not a device tensor".into()),
        };
        if perm.len() != t.shape.len() || perm.iter().any(|&d| d >= t.shape.len()) {
            return Err("a MatMul operand read through no permutation of its axes".into());
        }
        let st = contiguous(&t.shape);
        Ok(Strided {
            t,
            shape: perm.iter().map(|&d| t.shape[d]).collect(),
            strides: perm.iter().map(|&d| st[d]).collect(),
        })
    }

    /// The result `y` written through `perm` (the launch's Transpose epilogue): result axis
    /// `perm[j]` is `y`'s axis `j`.
    fn through(y: &'a TensorRef, perm: &[usize]) -> Strided<'a> {
        let (ys, r) = (contiguous(&y.shape), y.shape.len());
        let (mut shape, mut strides) = (vec![0usize; r], vec![0i64; r]);
        for (j, &d) in perm.iter().enumerate() {
            shape[d] = y.shape[j];
            strides[d] = ys[j];
        }
        Strided { t: y, shape, strides }
    }

    fn rows(&self) -> usize {
        self.shape[self.shape.len() - 2]
    }

    fn cols(&self) -> usize {
        self.shape[self.shape.len() - 1]
    }

    /// Whether each matrix is stored column by column (its rows contiguous), and its leading
    /// dim; `Err` where neither axis is contiguous.
    fn layout(&self) -> Result<(bool, i64), String> {
        let r = self.shape.len();
        let (sr, sc) = (self.strides[r - 2], self.strides[r - 1]);
        match (sr, sc) {
            (_, 1) => Ok((false, sr.max(self.cols() as i64).max(1))),
            (1, _) => Ok((true, sc.max(self.rows() as i64).max(1))),
            _ => Err("a matrix with neither axis contiguous".into()),
        }
    }

    /// The element offset of each matrix over the product's batch dims `batch` (this operand's
    /// batch dims right-aligned with them; 0 along one it broadcasts).
    fn offsets(&self, batch: &[usize]) -> Vec<i64> {
        let own = self.shape.len() - 2;
        (0..numel(batch) as usize)
            .map(|i| {
                let (mut lin, mut off) = (i, 0i64);
                for (d, &size) in batch.iter().enumerate().rev() {
                    let c = (lin % size) as i64;
                    lin /= size;
                    if let Some(od) = (d + own).checked_sub(batch.len()) {
                        if self.shape[od] != 1 {
                            off += c * self.strides[od];
                        }
                    }
                }
                off
            })
            .collect()
    }
}

/// A MatMul whose operands or result lie other than as plain row-major batches: an operand read
/// through a permutation (attention's heads split from `[B, S, H, D]`, [`Operand::Permuted`]), or
/// the result written through its Transpose epilogue (the heads merged back). Each matrix has
/// one contiguous axis and a leading dim; a result stored column by column is computed
/// transposed (`Yᵀ = Bᵀ Aᵀ`). Where no single stride walks the matrices of an operand or of the
/// result, one batched GEMM reads the addresses of all of them from arrays in the aux bytes.
fn plan_matmul_strided(p: &mut Planner, perm: Option<&[usize]>) -> Result<(), String> {
    let l = p.l;
    let (a, b) = (Strided::operand(&l.inputs[0])?, Strided::operand(&l.inputs[1])?);
    let y = p.output(0)?;
    let r = y.shape.len();
    let id: Vec<usize> = (0..r).collect();
    let perm = perm.unwrap_or(&id);
    let mut sorted = perm.to_vec();
    sorted.sort_unstable();
    if a.shape.len() < 2 || b.shape.len() < 2 || r < 2 || sorted != id {
        return Err("a strided MatMul of operands of rank below 2, or through no permutation of its result".into());
    }
    let c = Strided::through(y, perm);
    let (m, k, n) = (a.rows(), a.cols(), b.cols());
    if b.rows() != k || c.rows() != m || c.cols() != n {
        return Err("MatMul operands whose dims do not agree".into());
    }
    if k == 0 {
        p.out.calls.push(Call::Fill { to: buf(y), bytes: y.bytes(), byte: 0 });
        return Ok(());
    }
    let ((a_cols, lda), (b_cols, ldb), (c_cols, ldc)) = (a.layout()?, b.layout()?, c.layout()?);
    // cuBLAS computes a column-major D = op(A) op(B). A row-major result is column-major Yᵀ =
    // Bᵀ Aᵀ; a column-major one is Y = A B. A row-major operand read as its transpose needs no
    // flag; read as itself, the flag.
    let (first, second, trans_a, trans_b, lda, ldb, mc, nc) =
        if !c_cols { (&b, &a, b_cols, a_cols, ldb, lda, n, m) } else { (&a, &b, !a_cols, !b_cols, lda, ldb, m, n) };
    let batch_shape = &c.shape[..r - 2];
    let batch = numel(batch_shape) as usize;
    let (o1, o2, oc) = (first.offsets(batch_shape), second.offsets(batch_shape), c.offsets(batch_shape));
    // One stride per matrix where the offsets allow it, else arrays of addresses.
    let step = |o: &[i64]| o.get(1).copied().unwrap_or(0);
    let uniform = |o: &[i64]| o.iter().enumerate().all(|(i, &v)| v == i as i64 * step(o));
    let pointers = if [&o1, &o2, &oc].iter().all(|o| uniform(o)) {
        None
    } else {
        let mut arrays = [Buf::Aux(0); 3];
        for (slot, (t, o)) in [(first.t, &o1), (second.t, &o2), (y, &oc)].into_iter().enumerate() {
            let table = p.aux(&vec![0u8; 8 * batch]);
            let Buf::Aux(at) = table else { unreachable!("aux bytes") };
            let es = t.dtype.size() as i64;
            for (i, &off) in o.iter().enumerate() {
                p.out.addresses.push((at + 8 * i as u64, buf(t).at((off * es) as u64)));
            }
            arrays[slot] = table;
        }
        Some(arrays)
    };
    p.gemm(Gemm {
        dtype: y.dtype,
        c_dtype: y.dtype,
        trans_a,
        trans_b,
        m: mc as i64,
        n: nc as i64,
        k: k as i64,
        alpha: 1.0,
        beta: 0.0,
        a: buf(first.t),
        lda,
        stride_a: step(&o1),
        b: buf(second.t),
        ldb,
        stride_b: step(&o2),
        c: buf(y),
        ldc,
        stride_c: step(&oc),
        batch: batch as i64,
        pointers,
    });
    Ok(())
}

/// Einsum of up to three float operands, one thread per output element summing in f64 in the
/// CPU reference's order (a contraction kernel, not a GEMM: Einsum in exported models is rare).
pub(super) fn plan_einsum(p: &mut Planner, equation: &str) -> Result<(), String> {
    let (terms, rhs) = mpc_ir::ops::einsum_parts(equation)?;
    let lhs = terms.join(",");
    let ins: Vec<&TensorRef> = (0..terms.len()).map(|i| p.input(i)).collect::<Result<_, _>>()?;
    if ins.len() > 3 {
        return Err(format!("Einsum of {} operands (the CUDA kernel takes up to 3)", ins.len()));
    }
    let y = p.output(0)?;
    let mut letters: Vec<char> = rhs.chars().collect();
    for c in lhs.chars().filter(|c| c.is_ascii_alphabetic()) {
        if !letters.contains(&c) {
            letters.push(c);
        }
    }
    let mut sizes = vec![0i64; letters.len()];
    let mut strides = vec![vec![0i64; letters.len()]; 3];
    for (k, (t, x)) in terms.iter().zip(&ins).enumerate() {
        if t.len() != x.shape.len() || x.dtype != y.dtype {
            return Err(format!("Einsum term `{t}` on {}{:?}", x.dtype, x.shape));
        }
        let st = contiguous(&x.shape);
        for (i, c) in t.chars().enumerate() {
            let l = letters.iter().position(|&l| l == c).ok_or("an Einsum label")?;
            sizes[l] = x.shape[i] as i64;
            strides[k][l] += st[i];
        }
    }
    let nout = rhs.chars().count();
    let n_out: i64 = sizes[..nout].iter().product();
    let inner: i64 = sizes[nout..].iter().product();
    let ptr = |k: usize| ins.get(k).map_or(Arg::Null, |t| Arg::Ptr(buf(t)));
    let args = vec![
        ptr(0),
        ptr(1),
        ptr(2),
        Arg::Ptr(buf(y)),
        Arg::I64(n_out),
        Arg::I64(inner),
        Arg::I32(ins.len() as i32),
        Arg::I32(letters.len() as i32),
        Arg::I32(nout as i32),
        Arg::Dims(dims8(&sizes)?),
        Arg::Dims(dims8(&strides[0])?),
        Arg::Dims(dims8(&strides[1])?),
        Arg::Dims(dims8(&strides[2])?),
    ];
    p.flat("reduce", format!("reduce_einsum_{}", float_tag(y.dtype)?), n_out as u64, args);
    Ok(())
}

/// ONNX Gemm: one cuBLAS GEMM, its C (broadcast into the output first) taken with `beta`.
pub(super) fn plan_gemm(p: &mut Planner, a: &mpc_ir::ops::GemmAttrs) -> Result<(), String> {
    let (x, w, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
    if x.shape.len() != 2 || w.shape.len() != 2 {
        return Err("Gemm of operands that are not matrices".into());
    }
    // The product's rows and columns (y holds them, maybe viewed in another shape by the
    // epilogue that writes it).
    let (m, n) =
        (if a.transA { x.shape[1] } else { x.shape[0] } as i64, if a.transB { w.shape[0] } else { w.shape[1] } as i64);
    if y.numel() as i64 != m * n {
        return Err(format!("a Gemm of {m} x {n} into {:?}", y.shape));
    }
    let k = if a.transA { x.shape[0] } else { x.shape[1] } as i64;
    let c = p.opt_input(2).filter(|_| a.beta != 0.0);
    // A bias: C holds one value per output column ([n] or [1, n]) and is added as it is.
    let bias = c.filter(|c| {
        a.beta == 1.0 && c.shape.last() == Some(&(n as usize)) && c.shape.iter().rev().skip(1).all(|&d| d == 1)
    });
    // A ReLU the launch applies as it writes y (its epilogue), or a ReLU's or GELU's gradient.
    let relu = matches!(p.l.epilogue, Some(Op::Relu));
    let (relu_grad_of, gelu_grad_of) = gemm_epilogue_grads(p, y, c.is_some())?;
    // Where the ReLU's signs are kept as bits (cuBLASLt's layout over column-major D, m x n).
    let shape = relu_mask_shape(m as usize, n as usize);
    let mask = p.l.relu_mask.as_ref().filter(|t| t.shape == shape && p.opts.relu_masks);
    let mask = mask.map(|t| LtMask { buf: buf(t), ld: 8 * shape[1] as i64 });
    let start = p.out.calls.len();
    let beta = match c {
        Some(c) => {
            p.expand(y.dtype, buf(c), &c.shape, buf(y), &y.shape)?;
            a.beta as f64
        }
        None => 0.0,
    };
    // Row-major Y = op(X) op(W) is column-major Yᵀ = op(W)ᵀ op(X)ᵀ.
    let gemm = Gemm {
        dtype: y.dtype,
        c_dtype: y.dtype,
        trans_a: a.transB,
        trans_b: a.transA,
        m: n,
        n: m,
        k,
        alpha: a.alpha as f64,
        beta,
        a: buf(w),
        lda: if a.transB { k } else { n },
        stride_a: 0,
        b: buf(x),
        ldb: if a.transA { m } else { k },
        stride_b: 0,
        c: buf(y),
        ldc: n,
        stride_c: 0,
        batch: 1,
        pointers: None,
    };
    p.gemm(gemm.clone());
    gemm_plain_epilogue(p, y, relu, relu_grad_of.as_ref(), gelu_grad_of.as_ref())?;
    // A weight gradient's sibling, the bias gradient: the column sums of dY, which is X (cuBLAS's
    // B, read transposed: `m` values) or W (cuBLAS's A: `n` values), of y's dtype. Its own
    // calls follow the product's.
    let bgrad = match p.l.sibling.as_deref() {
        Some(s)
            if a.transA
                && !a.transB
                && a.alpha == 1.0
                && c.is_none()
                && !relu
                && relu_grad_of.is_none()
                && gelu_grad_of.is_none() =>
        {
            gemm_bias_grad(p, s, (x, w, y), (m, n))?
        }
        _ => None,
    };
    // cuBLASLt adds the bias and applies the ReLU as it writes the product: one pass over y
    // instead of up to four (the broadcast bias written, read by the product, then the ReLU's);
    // or it sums dY's columns as it reads them for the product.
    // Or it applies a ReLU's gradient from the bits the ReLU's product kept: reading an eighth or
    // a sixteenth of the bytes of the ReLU's output, with no pass over y of its own.
    let lt_types = matches!(y.dtype, DType::F32 | DType::F16 | DType::BF16);
    let relu_grad = relu_grad_of.is_some() && mask.is_some();
    // Or it applies the GELU's gradient from the GELU's input, of D's layout (cuBLASLt's DGELU).
    let gelu_grad = gelu_grad_of.map(|h| LtAux { buf: buf(&h), ld: n });
    let epilogue = bias.is_some() || relu || bgrad.is_some() || relu_grad || gelu_grad.is_some();
    if epilogue && (bias.is_some() || c.is_none()) && lt_types && m > 0 && n > 0 && k > 0 {
        let fallback = p.out.calls.split_off(start);
        let gemm = Gemm { beta: 0.0, ..gemm };
        let mask = mask.filter(|_| relu || relu_grad);
        let bias = bias.map(buf);
        let lt = LtGemm { gemm, bias, relu, relu_grad, mask, gelu_grad, bgrad, fallback };
        p.out.calls.push(Call::Lt(Box::new(lt)));
    }
    Ok(())
}

/// A Gemm's gradient epilogue and its operand: a ReLU's gradient (y where the ReLU's output is
/// above 0, else 0) or the tanh GELU's (y's at the GELU's input). Neither goes with a C.
fn gemm_epilogue_grads(
    p: &Planner,
    y: &TensorRef,
    has_c: bool,
) -> Result<(Option<TensorRef>, Option<TensorRef>), String> {
    let relu_grad_of = match (&p.l.epilogue, &p.l.epilogue_operand) {
        (Some(Op::ReluGrad), Some(Operand::Device(r))) if r.dtype == y.dtype && r.numel() == y.numel() && !has_c => {
            Some(r.clone())
        }
        (Some(Op::ReluGrad), _) => return Err("a ReluGrad epilogue on a Gemm with C, or of another shape".into()),
        _ => None,
    };
    let gelu_grad_of = match (&p.l.epilogue, &p.l.epilogue_operand) {
        (Some(Op::GeluGrad(g)), Some(Operand::Device(h)))
            if g.approximate == GeluApprox::Tanh && h.dtype == y.dtype && h.numel() == y.numel() && !has_c =>
        {
            Some(h.clone())
        }
        (Some(Op::GeluGrad(_)), _) => return Err("a GeluGrad epilogue on a Gemm with C, or of another shape".into()),
        _ => None,
    };
    Ok((relu_grad_of, gelu_grad_of))
}

/// A Gemm's ReLU, ReLU gradient or GELU gradient (of `relu_grad_of`, `gelu_grad_of`) applied
/// to y in place after the product: what cuBLASLt would do as it writes, where it does not.
fn gemm_plain_epilogue(
    p: &mut Planner,
    y: &TensorRef,
    relu: bool,
    relu_grad_of: Option<&TensorRef>,
    gelu_grad_of: Option<&TensorRef>,
) -> Result<(), String> {
    let n_out = y.numel() as u64;
    if relu && n_out > 0 {
        let args = vec![Arg::Ptr(buf(y)), Arg::Ptr(buf(y)), Arg::I64(n_out as i64), Arg::F32(0.0), Arg::F32(0.0)];
        p.flat("elementwise", format!("elementwise_relu_{}", float_tag(y.dtype)?), n_out, args);
    }
    if let Some(r) = relu_grad_of {
        if n_out > 0 {
            let args = vec![Arg::Ptr(buf(y)), Arg::Ptr(buf(r)), Arg::Ptr(buf(y)), Arg::I64(n_out as i64)];
            p.flat("train", format!("train_relu_grad_{}", float_tag(y.dtype)?), n_out, args);
        }
    }
    if let Some(h) = gelu_grad_of {
        if n_out > 0 {
            // The GELU's gradient kernel over the product, in place.
            super::train::gelu_grad(p, y, h, y, GeluApprox::Tanh)?;
        }
    }
    Ok(())
}

/// The bias gradient sibling `s` of a weight gradient: the column sums of dY, which is X
/// (cuBLAS's B, read transposed: `m` values) or W (cuBLAS's A: `n` values), of y's dtype, for
/// cuBLASLt to sum as it reads; its own plain calls follow the product's.
fn gemm_bias_grad(
    p: &mut Planner,
    s: &Launch,
    (x, w, y): (&TensorRef, &TensorRef, &TensorRef),
    (m, n): (i64, i64),
) -> Result<Option<(Buf, GradOf)>, String> {
    let (dy, db) = (s.inputs.first(), s.outputs.first());
    let reads = |t: &TensorRef| matches!(dy, Some(Operand::Device(d)) if buf(d) == buf(t) && d.numel() == t.numel());
    let of = match () {
        _ if reads(x) => Some((GradOf::B, m)),
        _ if reads(w) => Some((GradOf::A, n)),
        _ => None,
    };
    let bgrad = match (of, db) {
        (Some((of, len)), Some(db))
            if matches!(s.op, Op::ReduceSum(_)) && db.dtype == y.dtype && db.numel() == len as usize =>
        {
            Some((buf(db), of))
        }
        _ => None,
    };
    p.plan_sibling(s)?;
    Ok(bgrad)
}

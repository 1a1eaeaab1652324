//! Plans of convolutions: cuDNN calls with their fallbacks (im2col / col2im and GEMMs), and
//! transposed convolutions.

use super::*;

pub(super) fn plan_conv(p: &mut Planner) -> Result<(), String> {
    let op = p.l.op.clone();
    let (Op::Conv(a) | Op::ConvGrad(a)) = &op else { unreachable!("not a convolution") };
    let grad = matches!(op, Op::ConvGrad(_));
    let (x, wt) = if grad { (p.input(1)?, p.input(2)?) } else { (p.input(0)?, p.input(1)?) };
    if x.shape.len() < 3 || wt.shape.len() != x.shape.len() {
        return Err("convolution operands of unexpected ranks".into());
    }
    let kernel: Vec<i64> = wt.shape[2..].iter().map(|&k| k as i64).collect();
    let spec: WindowSpec = a.window(&kernel);
    let w = spec.resolve(&x.shape[2..])?;
    let win = window3(&w, &x.shape[2..])?;
    let (n, c, m) = (x.shape[0] as u64, x.shape[1] as u64, wt.shape[0] as u64);
    let g = a.group.max(1) as u64;
    let kvol = numel(&w.kernel);
    let cs = ConvShape {
        x,
        wt,
        t: float_tag(x.dtype)?,
        es: x.dtype.size() as u64,
        n,
        c,
        m,
        g,
        cg: c / g,
        mg: m / g,
        ivol: numel(&x.shape[2..]),
        ovol: numel(&w.out),
        rows: c / g * kvol,
        pointwise: kvol == 1 && w.strides.iter().all(|&s| s == 1) && w.pads_begin.iter().all(|&q| q == 0),
        w,
        win,
        start: p.out.calls.len(),
        work_start: p.out.workspace,
    };
    if grad {
        conv_grad(p, &cs)
    } else {
        conv_forward(p, &cs)
    }
}

/// A convolution's operands and sizes (per group: `cg` input and `mg` output channels; `rows`
/// the columns' rows, `cg` times the kernel's volume), and where its calls and scratch start
/// (for cuDNN to stand in for them).
struct ConvShape<'a> {
    x: &'a TensorRef,
    wt: &'a TensorRef,
    w: Window,
    win: Window3,
    t: &'static str,
    es: u64,
    n: u64,
    c: u64,
    m: u64,
    g: u64,
    cg: u64,
    mg: u64,
    ivol: u64,
    ovol: u64,
    rows: u64,
    pointwise: bool,
    start: usize,
    work_start: u64,
}

impl ConvShape<'_> {
    fn im2col_args(&self, x: Buf, col: Buf, col_ld: u64, col_img: u64) -> Vec<Arg> {
        vec![
            Arg::Ptr(x),
            Arg::Ptr(col),
            Arg::I64(self.n as i64),
            Arg::I64(self.cg as i64),
            Arg::I64((self.c * self.ivol) as i64),
            Arg::I64(self.ivol as i64),
            Arg::Window(self.win),
            Arg::I64(col_ld as i64),
            Arg::I64(col_img as i64),
        ]
    }

    /// What cuDNN would compute instead of the calls from `start` on (2-D, symmetric pads).
    fn dnn(&self, ops: Vec<DnnOp>, y: &[usize]) -> Option<DnnConv> {
        let (x, w) = (self.x, &self.w);
        let four = |s: &[usize]| -> Option<[i64; 4]> { (s.len() == 4).then(|| [0, 1, 2, 3].map(|i| s[i] as i64)) };
        let two = |v: &[usize]| -> Option<[i64; 2]> { (v.len() == 2).then(|| [v[0] as i64, v[1] as i64]) };
        let float = matches!(x.dtype, DType::F32 | DType::F16 | DType::BF16);
        (float && w.pads_begin == w.pads_end).then_some(())?;
        Some(DnnConv {
            dtype: x.dtype,
            x: four(&x.shape)?,
            w: four(&self.wt.shape)?,
            y: four(y)?,
            pads: two(&w.pads_begin)?,
            strides: two(&w.strides)?,
            dilations: two(&w.dilations)?,
            groups: self.g as i64,
            ops,
            fallback: Vec::new(),
            fallback_workspace: 0,
        })
    }

    /// The calls from `start` on as cuDNN's fallback. Its scratch (the columns) is dead once it
    /// has run: the calls after it may take the same bytes, and a device running cuDNN instead
    /// needs none of it.
    fn wrap(&self, p: &mut Planner, conv: Option<DnnConv>) {
        if let Some(mut conv) = conv {
            conv.fallback = p.out.calls.split_off(self.start);
            conv.fallback_workspace = p.out.workspace;
            p.out.workspace = self.work_start;
            p.out.calls.push(Call::Conv(Box::new(conv)));
        }
    }
}

/// Conv: per group, im2col (unless the kernel is pointwise) and one batched GEMM over the
/// images, then the bias.
fn conv_forward(p: &mut Planner, cs: &ConvShape) -> Result<(), String> {
    let (x, wt, pointwise) = (cs.x, cs.wt, cs.pointwise);
    let (n, c, m, g, cg, mg, ivol, ovol, rows, es, t) =
        (cs.n, cs.c, cs.m, cs.g, cs.cg, cs.mg, cs.ivol, cs.ovol, cs.rows, cs.es, cs.t);
    let y = p.output(0)?;
    let conv = cs.dnn(vec![DnnOp::Forward { x: buf(x), w: buf(wt), y: buf(y) }], &y.shape);
    let col = if pointwise { None } else { Some(p.work(n * rows * ovol * es)) };
    for gi in 0..g {
        let xg = buf(x).at(gi * cg * ivol * es);
        // Per image: Y[i, group] (mg × ovol) = W_g (mg × rows) · col_i (rows × ovol).
        let (src, stride) = match col {
            None => (xg, (c * ivol) as i64),
            Some(col) => {
                p.flat(
                    "im2col",
                    format!("im2col_im2col_{t}"),
                    n * rows * ovol,
                    cs.im2col_args(xg, col, ovol, rows * ovol),
                );
                (col, (rows * ovol) as i64)
            }
        };
        p.gemm(Gemm {
            dtype: y.dtype,
            c_dtype: y.dtype,
            trans_a: false,
            trans_b: false,
            m: ovol as i64,
            n: mg as i64,
            k: rows as i64,
            alpha: 1.0,
            beta: 0.0,
            a: src,
            lda: ovol as i64,
            stride_a: stride,
            b: buf(wt).at(gi * mg * rows * es),
            ldb: rows as i64,
            stride_b: 0,
            c: buf(y).at(gi * mg * ovol * es),
            ldc: ovol as i64,
            stride_c: (m * ovol) as i64,
            batch: n as i64,
            pointers: None,
        });
    }
    cs.wrap(p, conv);
    if let Some(b) = p.opt_input(2) {
        let dims = [n as usize, m as usize, ovol as usize];
        p.binary("add", t, (buf(y), &dims), (buf(b), &[m as usize, 1]), buf(y), &dims)?;
    }
    Ok(())
}

/// ConvGrad: dY (n, m, ovol) moved to (m, n·ovol) so that one GEMM per group sums the images.
/// Outputs nothing reads are not computed (a first convolution's dX).
fn conv_grad(p: &mut Planner, cs: &ConvShape) -> Result<(), String> {
    let (x, wt) = (cs.x, cs.wt);
    let (n, m, g, cg, mg, ivol, ovol, rows, es, t) =
        (cs.n, cs.m, cs.g, cs.cg, cs.mg, cs.ivol, cs.ovol, cs.rows, cs.es, cs.t);
    let dy = p.input(0)?;
    let l = p.l;
    let wanted = |k: usize| l.outputs.get(k).filter(|_| !l.unread.contains(&k));
    let (dx, dw, db) = (wanted(0), wanted(1), wanted(2));
    let mut ops = Vec::new();
    if let Some(dw) = dw {
        ops.push(DnnOp::BackwardFilter { x: buf(x), dy: buf(dy), dw: buf(dw) });
    }
    if let Some(dx) = dx {
        ops.push(DnnOp::BackwardData { w: buf(wt), dy: buf(dy), dx: buf(dx) });
    }
    let conv = cs.dnn(ops, &dy.shape);
    let k2 = n * ovol;
    let dyt = channels_first(p, dy, n, m, ovol)?;
    // The columns: x's for dW, then dX's, which stay f32 for a low-precision convolution so
    // that dX is rounded once, after col2im's sums.
    let (wide, col_dtype) = wide_columns(x.dtype);
    let col = p.work(rows * k2 * es.max(col_dtype.size() as u64));
    for gi in 0..g {
        let xg = buf(x).at(gi * cg * ivol * es);
        let dyt_g = dyt.at(gi * mg * k2 * es);
        if let Some(dw) = dw {
            // dW_g (mg × rows) = dYᵗ_g (mg × k2) · colᵀ; column-major: dW_gᵀ = col · dYᵗ_gᵀ.
            p.flat("im2col", format!("im2col_im2col_{t}"), n * rows * ovol, cs.im2col_args(xg, col, k2, ovol));
            p.gemm(Gemm {
                dtype: dw.dtype,
                c_dtype: dw.dtype,
                trans_a: true,
                trans_b: false,
                m: rows as i64,
                n: mg as i64,
                k: k2 as i64,
                alpha: 1.0,
                beta: 0.0,
                a: col,
                lda: k2 as i64,
                stride_a: 0,
                b: dyt_g,
                ldb: k2 as i64,
                stride_b: 0,
                c: buf(dw).at(gi * mg * rows * es),
                ldc: rows as i64,
                stride_c: 0,
                batch: 1,
                pointers: None,
            });
        }
        if let Some(dx) = dx {
            let (dtype, w_g) = (dx.dtype, buf(wt).at(gi * mg * rows * es));
            p.gemm(columns_of_a_transposed_conv(dtype, col_dtype, dyt_g, w_g, col, k2, rows, mg));
            let dxg = buf(dx).at(gi * cg * ivol * es);
            p.flat("im2col", format!("im2col_col2im_{wide}{t}"), n * cg * ivol, cs.im2col_args(col, dxg, k2, ovol));
        }
    }
    cs.wrap(p, conv);
    if let Some(db) = db {
        let args =
            vec![Arg::Ptr(buf(dy)), Arg::Ptr(buf(db)), Arg::I64(n as i64), Arg::I64(m as i64), Arg::I64(ovol as i64)];
        p.kernel("im2col", format!("im2col_channel_sum_{t}"), rows_grid(m), [BLOCK, 1, 1], args);
    }
    Ok(())
}

/// `t`, an (n, c, vol) batch of images, copied into the workspace as (c, n·vol): each channel's
/// values of every image side by side, so that one GEMM per group covers every image.
fn channels_first(p: &mut Planner, t: &TensorRef, n: u64, c: u64, vol: u64) -> Result<Buf, String> {
    let w = p.work(c * n * vol * t.dtype.size() as u64);
    let (dims, from, to) =
        ([c as usize, n as usize, vol as usize], [vol as i64, (c * vol) as i64, 1], [(n * vol) as i64, vol as i64, 1]);
    p.strided_copy(t.dtype, buf(t), w, &dims, &from, &to)?;
    Ok(w)
}

/// One group's columns of a transposed convolution (ConvGrad's dX, ConvTranspose's Y), for
/// col2im: col (rows × k2) = W_gᵀ · S_g, with S_g (k × k2) the group's channels of the input moved
/// to (channel, image · position) and W_g (k × rows) the group's weights, all row-major. In
/// cuBLAS's column-major terms: colᵀ = S_gᵀ · W_g.
#[allow(clippy::too_many_arguments)]
fn columns_of_a_transposed_conv(
    dtype: DType,
    col_dtype: DType,
    s_g: Buf,
    w_g: Buf,
    col: Buf,
    k2: u64,
    rows: u64,
    k: u64,
) -> Gemm {
    Gemm {
        dtype,
        c_dtype: col_dtype,
        trans_a: false,
        trans_b: true,
        m: k2 as i64,
        n: rows as i64,
        k: k as i64,
        alpha: 1.0,
        beta: 0.0,
        a: s_g,
        lda: k2 as i64,
        stride_a: 0,
        b: w_g,
        ldb: rows as i64,
        stride_b: 0,
        c: col,
        ldc: k2 as i64,
        stride_c: 0,
        batch: 1,
        pointers: None,
    }
}

/// The columns a GEMM leaves for col2im: f32 for f16/bf16 data (`im2col_col2im_wide_*`), else
/// the data's dtype.
fn wide_columns(d: DType) -> (&'static str, DType) {
    match d {
        DType::F16 | DType::BF16 => ("wide_", DType::F32),
        d => ("", d),
    }
}

pub(super) fn plan_conv_transpose(p: &mut Planner, a: &mpc_ir::ops::ConvAttrs) -> Result<(), String> {
    let (x, wt, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
    let sp = x.shape.len().saturating_sub(2);
    if sp == 0 || wt.shape.len() != x.shape.len() || y.shape.len() != x.shape.len() {
        return Err("ConvTranspose operands of unexpected ranks".into());
    }
    let kernel: Vec<i64> = wt.shape[2..].iter().map(|&k| k as i64).collect();
    let spec = a.window(&kernel);
    let mut w = Window {
        kernel: wt.shape[2..].to_vec(),
        strides: Vec::new(),
        dilations: Vec::new(),
        pads_begin: Vec::new(),
        pads_end: Vec::new(),
        out: x.shape[2..].to_vec(),
    };
    for d in 0..sp {
        let target = (!a.output_shape.is_empty()).then(|| a.output_shape[a.output_shape.len() - sp + d]);
        let pad = a.output_padding.get(d).copied().unwrap_or(0);
        let o = mpc_ir::geometry::conv_transpose_dim(&spec, d, x.shape[2 + d] as u64, pad, target)?;
        if o.out as usize != y.shape[2 + d] {
            return Err(format!("ConvTranspose output dim {} where the graph declares {}", o.out, y.shape[2 + d]));
        }
        w.strides.push(a.strides.get(d).copied().unwrap_or(1) as usize);
        w.dilations.push(a.dilations.get(d).copied().unwrap_or(1) as usize);
        w.pads_begin.push(o.pad_begin as usize);
        w.pads_end.push(o.pad_end as usize);
    }
    // col2im's geometry: the image is Y, the columns' positions are X's.
    let win = window3(&w, &y.shape[2..])?;
    let t = float_tag(x.dtype)?;
    let es = x.dtype.size() as u64;
    let (n, cin) = (x.shape[0] as u64, x.shape[1] as u64);
    let g = a.group.max(1) as u64;
    let (cg, og) = (cin / g, wt.shape[1] as u64);
    let cout = og * g;
    let (ivol, ovol, kvol) = (numel(&x.shape[2..]), numel(&y.shape[2..]), numel(&w.kernel));
    let (rows, k2) = (og * kvol, n * ivol);
    // X (n, cin, ivol) moved to (cin, n·ivol) so that one GEMM per group covers every image.
    let xt = channels_first(p, x, n, cin, ivol)?;
    let (wide, col_dtype) = wide_columns(x.dtype);
    let col = p.work(rows * k2 * col_dtype.size() as u64);
    for gi in 0..g {
        let (x_g, w_g) = (xt.at(gi * cg * k2 * es), buf(wt).at(gi * cg * rows * es));
        p.gemm(columns_of_a_transposed_conv(y.dtype, col_dtype, x_g, w_g, col, k2, rows, cg));
        let args = vec![
            Arg::Ptr(col),
            Arg::Ptr(buf(y).at(gi * og * ovol * es)),
            Arg::I64(n as i64),
            Arg::I64(og as i64),
            Arg::I64((cout * ovol) as i64),
            Arg::I64(ovol as i64),
            Arg::Window(win),
            Arg::I64(k2 as i64),
            Arg::I64(ivol as i64),
        ];
        p.flat("im2col", format!("im2col_col2im_{wide}{t}"), n * og * ovol, args);
    }
    if let Some(b) = p.opt_input(2) {
        let dims = [n as usize, cout as usize, ovol as usize];
        p.binary("add", t, (buf(y), &dims), (buf(b), &[cout as usize, 1]), buf(y), &dims)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::{Launch, Operand, Region};
    use mpc_ir::ops::ConvAttrs;

    /// A convolution cuDNN may take keeps its columns out of the plan's workspace: the
    /// fallback's scratch lies past the plan's own and is counted only where the fallback runs.
    #[test]
    fn a_convolutions_columns_are_scratch_only_where_its_fallback_runs() {
        let t = |offset: u64, shape: &[usize]| TensorRef {
            region: Region::Arena,
            offset,
            dtype: DType::F16,
            shape: shape.to_vec(),
        };
        let attrs = ConvAttrs { pads: vec![1; 4], kernel_shape: vec![3, 3], ..ConvAttrs::default() };
        // ResNet's 3x3 convolution of 64 channels over 56 x 56, batch 8, and its gradients.
        let (x, w, y) = (t(0, &[8, 64, 56, 56]), t(1 << 24, &[64, 64, 3, 3]), t(1 << 25, &[8, 64, 56, 56]));
        let forward = Launch::new(
            "conv",
            Op::Conv(Box::new(attrs.clone())),
            vec![Operand::Device(x.clone()), Operand::Device(w.clone())],
            vec![y.clone()],
        );
        let grad = Launch::new(
            "conv.grad",
            Op::ConvGrad(Box::new(attrs)),
            vec![Operand::Device(y), Operand::Device(x), Operand::Device(w)],
            vec![t(1 << 26, &[8, 64, 56, 56]), t(1 << 27, &[64, 64, 3, 3])],
        );
        let none = |_: &TensorRef| None;
        for (l, columns) in [(&forward, 8 * 576 * 3136 * 2), (&grad, 576 * 8 * 3136 * 4)] {
            let p = super::super::plan(l, &none).unwrap();
            let Some(Call::Conv(conv)) = p.calls.iter().find(|c| matches!(c, Call::Conv(_))) else {
                panic!("{}: no convolution for cuDNN", l.node)
            };
            assert!(p.workspace < 1 << 20, "{}: {} bytes of scratch beside cuDNN", l.node, p.workspace);
            assert!(conv.fallback_workspace >= p.workspace + columns, "{}: {}", l.node, conv.fallback_workspace);
            assert_eq!(p.workspace_with_fallbacks(), conv.fallback_workspace);
            assert_eq!(p.scratch_bytes(&[None]), conv.fallback_workspace);
            // cuDNN's own scratch lies past the plan's, 256-byte aligned.
            let at = p.library_scratch_at();
            assert!(at >= p.workspace && at % 256 == 0);
            assert_eq!(p.scratch_bytes(&[Some(1000)]), at + 1000);
            assert_eq!(p.scratch_bytes(&[Some(0)]), p.workspace.max(at));
        }
    }
}

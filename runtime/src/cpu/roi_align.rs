//! RoiAlign (Mask R-CNN's bilinear pooling of regions) and its gradient, sampling as onnxruntime
//! does: each output bin of a roi averages (or takes the largest weighted corner of) a grid of
//! bilinear samples, `sampling_ratio` per side or, at 0, as many as the bin is pixels wide
//! (rounded up). Coordinates are computed in the input's float dtype (f32 below f64) in
//! onnxruntime's order, so a sample on a pixel's edge falls on the same side.

use mpc_ir::ops::{RoiAlignAttrs, RoiCoordinates, RoiMode};

use super::{err, floats, store, Res};
use crate::value::HostTensor;

/// One bilinear sample: the four corners it reads (positions in an H×W plane) and their weights.
struct Sample {
    pos: [usize; 4],
    w: [f64; 4],
}

/// A roi's samples, bin by bin in (row, column) order, and the count each bin's average divides by.
struct Bins {
    samples: Vec<Vec<Sample>>,
    count: f64,
}

/// The bins of `roi` ([x1, y1, x2, y2]) on an `h`×`w` plane; `q` rounds to the arithmetic's dtype.
fn bins(roi: [f64; 4], a: &RoiAlignAttrs, (h, w): (usize, usize), q: impl Fn(f64) -> f64) -> Bins {
    let offset = if a.coordinate_transformation_mode == RoiCoordinates::HalfPixel { 0.5 } else { 0.0 };
    let scale = q(a.spatial_scale as f64);
    let at = |v: f64| q(q(v * scale) - offset);
    let (x0, y0, x1, y1) = (at(roi[0]), at(roi[1]), at(roi[2]), at(roi[3]));
    let (mut rw, mut rh) = (q(x1 - x0), q(y1 - y0));
    if offset == 0.0 {
        // Malformed rois are 1×1 (onnxruntime's output_half_pixel).
        (rw, rh) = (rw.max(1.0), rh.max(1.0));
    }
    let (oh, ow) = (a.output_height as usize, a.output_width as usize);
    let (bh, bw) = (q(rh / oh as f64), q(rw / ow as f64));
    let grid = |extent: f64, n: usize| {
        if a.sampling_ratio > 0 {
            a.sampling_ratio
        } else {
            q(extent / n as f64).ceil() as i64
        }
    };
    let (gh, gw) = (grid(rh, oh), grid(rw, ow));
    let count = (gh * gw).max(1) as f64;
    let mut samples = Vec::with_capacity(oh * ow);
    for ph in 0..oh {
        for pw in 0..ow {
            let mut bin = Vec::new();
            for iy in 0..gh.max(0) {
                let y = q(q(y0 + q(ph as f64 * bh)) + q(q((iy as f64 + 0.5) * bh) / gh as f64));
                for ix in 0..gw.max(0) {
                    let x = q(q(x0 + q(pw as f64 * bw)) + q(q((ix as f64 + 0.5) * bw) / gw as f64));
                    bin.push(sample(y, x, h, w, &q));
                }
            }
            samples.push(bin);
        }
    }
    Bins { samples, count }
}

/// The sample at (y, x): zero weights outside [-1, h] × [-1, w], else the corners clamped in.
fn sample(y: f64, x: f64, h: usize, w: usize, q: &impl Fn(f64) -> f64) -> Sample {
    if y < -1.0 || y > h as f64 || x < -1.0 || x > w as f64 {
        return Sample { pos: [0; 4], w: [0.0; 4] };
    }
    let side = |v: f64, n: usize| {
        let v = v.max(0.0);
        let lo = v as usize;
        if lo + 1 >= n {
            (n - 1, n - 1, (n - 1) as f64)
        } else {
            (lo, lo + 1, v)
        }
    };
    let ((ylo, yhi, y), (xlo, xhi, x)) = (side(y, h), side(x, w));
    let (ly, lx) = (q(y - ylo as f64), q(x - xlo as f64));
    let (hy, hx) = (q(1.0 - ly), q(1.0 - lx));
    Sample {
        pos: [ylo * w + xlo, ylo * w + xhi, yhi * w + xlo, yhi * w + xhi],
        w: [q(hy * hx), q(hy * lx), q(ly * hx), q(ly * lx)],
    }
}

/// The operands: X's [N, C, H, W], each roi's corners and batch index.
type Rois = (usize, usize, usize, usize, Vec<[f64; 4]>, Vec<usize>);

fn operands(x: &HostTensor, rois: &HostTensor, batch: &HostTensor) -> Res<Rois> {
    let [n, c, h, w] = x.shape[..] else { return Err(err(format!("RoiAlign's X is {:?}, not [N, C, H, W]", x.shape))) };
    let r = floats(rois, "rois")?;
    let idx = batch.i64s().ok_or_else(|| err("RoiAlign's batch_indices are not integers"))?;
    if rois.shape.len() != 2 || rois.shape[1] != 4 || idx.len() != rois.shape[0] {
        return Err(err(format!("RoiAlign's rois are {:?} for {} batch indices", rois.shape, idx.len())));
    }
    let idx: Vec<usize> = idx
        .iter()
        .map(|&b| usize::try_from(b).ok().filter(|&b| b < n))
        .collect::<Option<_>>()
        .ok_or_else(|| err(format!("RoiAlign's batch_indices {idx:?} are not all in [0, {n})")))?;
    if h == 0 || w == 0 {
        return Err(err(format!("RoiAlign samples an empty plane of {h}x{w}")));
    }
    Ok((n, c, h, w, r.chunks_exact(4).map(|q| [q[0], q[1], q[2], q[3]]).collect(), idx))
}

/// The rounding of `x`'s arithmetic: f64 for f64, else f32.
fn rounding(x: &HostTensor) -> fn(f64) -> f64 {
    if x.dtype() == mpc_ir::DType::F64 {
        |v| v
    } else {
        |v| v as f32 as f64
    }
}

/// The output of one bin over a plane `v`, and the (sample, corner) its max mode picked.
fn pooled(
    bin: &[Sample],
    count: f64,
    mode: RoiMode,
    v: &[f64],
    q: impl Fn(f64) -> f64,
) -> (f64, Option<(usize, usize)>) {
    match mode {
        RoiMode::Avg => {
            let mut s = 0.0;
            for p in bin {
                let t = q(q(q(q(p.w[0] * v[p.pos[0]]) + q(p.w[1] * v[p.pos[1]])) + q(p.w[2] * v[p.pos[2]]))
                    + q(p.w[3] * v[p.pos[3]]));
                s = q(s + t);
            }
            (q(s / count), None)
        }
        RoiMode::Max => {
            // onnxruntime's std::max, in its order: corners nested within a sample, then samples;
            // max(a, b) is b only when a < b, so a NaN first stays and a NaN second is passed over.
            let mut best: Option<(f64, (usize, usize))> = None;
            for (i, p) in bin.iter().enumerate() {
                let mut s = (q(p.w[0] * v[p.pos[0]]), 0);
                for k in 1..4 {
                    let t = q(p.w[k] * v[p.pos[k]]);
                    if s.0 < t {
                        s = (t, k);
                    }
                }
                if best.is_none_or(|(b, _)| b < s.0) {
                    best = Some((s.0, (i, s.1)));
                }
            }
            best.map_or((0.0, None), |(b, at)| (b, Some(at)))
        }
    }
}

pub(crate) fn roi_align(x: &HostTensor, rois: &HostTensor, batch: &HostTensor, a: &RoiAlignAttrs) -> Res<HostTensor> {
    let (_, c, h, w, rois_v, idx) = operands(x, rois, batch)?;
    let (v, q) = (x.f64s(), rounding(x));
    let plane = h * w;
    let mut out = Vec::with_capacity(rois_v.len() * c * (a.output_height * a.output_width) as usize);
    for (roi, &b) in rois_v.iter().zip(&idx) {
        let bins = bins(roi.map(q), a, (h, w), q);
        for ch in 0..c {
            let at = (b * c + ch) * plane;
            for bin in &bins.samples {
                out.push(pooled(bin, bins.count, a.mode, &v[at..at + plane], q).0);
            }
        }
    }
    let shape = vec![rois_v.len(), c, a.output_height as usize, a.output_width as usize];
    Ok(store(x, shape, out))
}

/// ai.mpc::RoiAlignGrad: dX, each output's dY added to the corners its samples read, times their
/// weights over the bin's count (avg), or to the corner its max picked times that weight.
pub(crate) fn roi_align_grad(
    dy: &HostTensor,
    x: &HostTensor,
    rois: &HostTensor,
    batch: &HostTensor,
    a: &RoiAlignAttrs,
) -> Res<HostTensor> {
    let (_, c, h, w, rois_v, idx) = operands(x, rois, batch)?;
    let (v, g, q) = (x.f64s(), dy.f64s(), rounding(x));
    let plane = h * w;
    let bins_per = (a.output_height * a.output_width) as usize;
    if g.len() != rois_v.len() * c * bins_per {
        return Err(err(format!("RoiAlignGrad: dY {:?} for {} rois", dy.shape, rois_v.len())));
    }
    let mut dx = vec![0f64; v.len()];
    for (r, (roi, &b)) in rois_v.iter().zip(&idx).enumerate() {
        let bins = bins(roi.map(q), a, (h, w), q);
        for ch in 0..c {
            let at = (b * c + ch) * plane;
            for (k, bin) in bins.samples.iter().enumerate() {
                let d = g[(r * c + ch) * bins_per + k];
                if a.mode == RoiMode::Avg {
                    for p in bin {
                        for (pos, wt) in p.pos.iter().zip(p.w) {
                            dx[at + pos] += d * wt / bins.count;
                        }
                    }
                } else if let Some((s, corner)) = pooled(bin, bins.count, a.mode, &v[at..at + plane], q).1 {
                    // Max: the corner the forward picked (the plane is read only to find it).
                    dx[at + bin[s].pos[corner]] += d * bin[s].w[corner];
                }
            }
        }
    }
    Ok(store(x, x.shape.clone(), dx))
}

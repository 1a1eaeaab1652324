//! Resize: nearest and (multi)linear, separable per axis, with ONNX's coordinate transformations.
//! Cubic, antialiasing, aspect-ratio policies and tf_crop_and_resize are reported as unsupported.

use mpc_ir::ops::{AspectPolicy, CoordinateMode, NearestMode, ResizeAttrs, ResizeMode};

use super::{err, unsupported, Res};
use crate::value::HostTensor;

/// The input coordinate of output coordinate `x` along one axis.
fn source(mode: CoordinateMode, x: f64, scale: f64, in_len: usize, out_len: usize) -> Res<f64> {
    Ok(match mode {
        CoordinateMode::HalfPixel => (x + 0.5) / scale - 0.5,
        CoordinateMode::HalfPixelSymmetric => {
            let adj = out_len as f64 / (scale * in_len as f64);
            let center = in_len as f64 / 2.0;
            let offset = center * (1.0 - adj);
            offset + (x + 0.5) / scale - 0.5
        }
        CoordinateMode::PytorchHalfPixel => {
            if out_len > 1 {
                (x + 0.5) / scale - 0.5
            } else {
                0.0
            }
        }
        CoordinateMode::AlignCorners => {
            if out_len > 1 {
                x * (in_len as f64 - 1.0) / (out_len as f64 - 1.0)
            } else {
                0.0
            }
        }
        CoordinateMode::Asymmetric => x / scale,
        CoordinateMode::TfCropAndResize => {
            return Err(unsupported("Resize coordinate_transformation_mode tf_crop_and_resize"))
        }
    })
}

fn nearest(mode: NearestMode, v: f64) -> f64 {
    match mode {
        NearestMode::Floor => v.floor(),
        NearestMode::Ceil => v.ceil(),
        NearestMode::RoundPreferCeil => (v + 0.5).floor(),
        NearestMode::RoundPreferFloor => {
            // round_prefer_floor: halves go down.
            if v.fract() == 0.5 {
                v.floor()
            } else {
                v.round()
            }
        }
    }
}

pub(crate) fn resize(
    x: &HostTensor,
    scales: Option<&HostTensor>,
    sizes: Option<&HostTensor>,
    a: &ResizeAttrs,
) -> Res<HostTensor> {
    if a.antialias || a.keep_aspect_ratio_policy != AspectPolicy::Stretch || a.mode == ResizeMode::Cubic {
        return Err(unsupported("Resize with cubic mode, antialias or an aspect-ratio policy"));
    }
    let rank = x.shape.len();
    let axes: Vec<usize> = if a.axes.is_empty() {
        (0..rank).collect()
    } else {
        a.axes
            .iter()
            .map(|&d| mpc_ir::normalize_axis(d, rank).ok_or_else(|| err("axis out of range")))
            .collect::<Res<_>>()?
    };
    let mut out_shape = x.shape.clone();
    let mut scale = vec![1f64; rank];
    match (sizes.filter(|s| !s.is_empty()), scales.filter(|s| !s.is_empty())) {
        (Some(s), _) => {
            for (&ax, &n) in axes.iter().zip(&s.i64s().ok_or_else(|| err("sizes must be integers"))?) {
                out_shape[ax] = n as usize;
                scale[ax] = n as f64 / x.shape[ax] as f64;
            }
        }
        (None, Some(s)) => {
            for (&ax, &f) in axes.iter().zip(&s.f64s()) {
                out_shape[ax] = (x.shape[ax] as f64 * f).floor() as usize;
                scale[ax] = f;
            }
        }
        _ => return Err(err("Resize needs scales or sizes")),
    }
    // Per axis and output coordinate: (index, weight) pairs.
    let mut taps: Vec<Vec<Vec<(usize, f64)>>> = Vec::with_capacity(rank);
    for d in 0..rank {
        let (n, m) = (x.shape[d], out_shape[d]);
        let mut per = Vec::with_capacity(m);
        for o in 0..m {
            if n == m && scale[d] == 1.0 {
                per.push(vec![(o, 1.0)]);
                continue;
            }
            let s = source(a.coordinate_transformation_mode, o as f64, scale[d], n, m)?;
            per.push(if a.mode == ResizeMode::Nearest {
                vec![(nearest(a.nearest_mode, s).clamp(0.0, n as f64 - 1.0) as usize, 1.0)]
            } else {
                let s = s.clamp(0.0, n as f64 - 1.0);
                let i0 = s.floor() as usize;
                let i1 = (i0 + 1).min(n - 1);
                let w = s - i0 as f64;
                vec![(i0, 1.0 - w), (i1, w)]
            });
        }
        taps.push(per);
    }
    let v = x.f64s();
    let ist = super::shape::strides(&x.shape);
    let ost = super::shape::strides(&out_shape);
    let total: usize = out_shape.iter().product();
    let mut out = Vec::with_capacity(total);
    for k in 0..total {
        // Sum over the product of every axis's taps.
        let mut acc = vec![(0usize, 1.0f64)];
        for d in 0..rank {
            let o = (k / ost[d]) % out_shape[d];
            let stride = ist[d];
            acc = acc
                .iter()
                .flat_map(|&(p, w)| taps[d][o].iter().map(move |&(i, tw)| (p + i * stride, w * tw)))
                .collect();
        }
        out.push(acc.iter().map(|&(p, w)| v[p] * w).sum::<f64>());
    }
    Ok(if x.dtype().is_float() {
        if x.dtype() == mpc_ir::DType::F64 {
            HostTensor { shape: out_shape, data: crate::value::Data::F64(out) }
        } else {
            HostTensor::from_f32(x.dtype(), out_shape, out.into_iter().map(|v| v as f32).collect())
        }
    } else {
        HostTensor::from_f64(x.dtype(), out_shape, out.into_iter().map(f64::round).collect())
    })
}

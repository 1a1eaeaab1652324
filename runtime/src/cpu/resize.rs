//! Resize: nearest, (multi)linear and cubic, antialiased or not, separable per axis, with ONNX's
//! coordinate transformations (tf_crop_and_resize's roi and extrapolation too) and aspect-ratio
//! policies.

use mpc_ir::ops::ResizeAttrs;

use super::{err, unsupported, Res};
use crate::value::HostTensor;

pub(crate) fn resize(
    x: &HostTensor,
    roi: Option<&HostTensor>,
    scales: Option<&HostTensor>,
    sizes: Option<&HostTensor>,
    a: &ResizeAttrs,
) -> Res<HostTensor> {
    let rank = x.shape.len();
    let sizes = match sizes.filter(|s| !s.is_empty()) {
        Some(s) => Some(s.i64s().ok_or_else(|| err("sizes must be integers"))?),
        None => None,
    };
    let scales = scales.map(|s| s.f64s());
    let (out_shape, scale) =
        mpc_ir::geometry::resize_plan(a, &x.shape, scales.as_deref(), sizes.as_deref()).map_err(err)?;
    let roi = mpc_ir::geometry::resize_roi(a, rank, roi.map(|r| r.f64s()).as_deref()).map_err(err)?;
    // Per axis and output coordinate: (index, weight) pairs.
    let mut taps: Vec<Vec<Vec<(usize, f64)>>> = Vec::with_capacity(rank);
    for d in 0..rank {
        taps.push(mpc_ir::geometry::resize_taps(a, x.shape[d], out_shape[d], scale[d], roi[d]).map_err(unsupported)?);
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
        // No taps on some axis: a tf_crop_and_resize output outside the input.
        out.push(match acc.is_empty() {
            true => f64::from(a.extrapolation_value),
            false => acc.iter().map(|&(p, w)| v[p] * w).sum::<f64>(),
        });
    }
    Ok(if x.dtype().is_float() {
        if x.dtype() == mpc_ir::DType::F64 {
            HostTensor { shape: out_shape, data: crate::value::Data::F64(out.into()) }
        } else {
            HostTensor::from_f32(x.dtype(), out_shape, out.into_iter().map(|v| v as f32).collect())
        }
    } else {
        HostTensor::from_f64(x.dtype(), out_shape, out.into_iter().map(f64::round).collect())
    })
}

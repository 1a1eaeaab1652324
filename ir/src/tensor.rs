//! Tensors with data: initializers and constant attributes.
//!
//! Data is little-endian bytes in a reference-counted [`Bytes`] buffer. An initializer decoded from a
//! model file shares the file's buffer (no copy), and cloning a tensor is cheap, which is what keeps
//! import + export of a large model within a small multiple of its file size.

use std::fmt;

use bytes::Bytes;
use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use crate::DType;

/// A dense tensor: dtype, static shape, little-endian data.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "TensorRepr", try_from = "TensorRepr")]
pub struct Tensor {
    dtype: DType,
    shape: Vec<u64>,
    data: Bytes,
}

impl Tensor {
    /// A tensor over `data`; errors when the byte length disagrees with the shape.
    pub fn from_bytes(dtype: DType, shape: Vec<u64>, data: Bytes) -> Result<Tensor, String> {
        let numel = numel(&shape).ok_or("element count overflows")?;
        let want = numel.checked_mul(dtype.size() as u64).ok_or("byte count overflows")?;
        if data.len() as u64 != want {
            return Err(format!("{} bytes of data for {dtype}{:?} ({want} bytes expected)", data.len(), shape));
        }
        Ok(Tensor { dtype, shape, data })
    }

    pub fn from_f32(shape: Vec<u64>, values: &[f32]) -> Tensor {
        Self::from_le(DType::F32, shape, values, |v, out| out.extend_from_slice(&v.to_le_bytes()))
    }

    pub fn from_i64(shape: Vec<u64>, values: &[i64]) -> Tensor {
        Self::from_le(DType::I64, shape, values, |v, out| out.extend_from_slice(&v.to_le_bytes()))
    }

    /// A tensor of `dtype` holding `values` converted from f64 (saturating for integers).
    pub fn from_f64_as(dtype: DType, shape: Vec<u64>, values: &[f64]) -> Tensor {
        Self::from_le(dtype, shape, values, |&v, out| encode_f64(dtype, v, out))
    }

    pub fn scalar_i64(v: i64) -> Tensor {
        Self::from_i64(vec![], &[v])
    }

    fn from_le<T>(dtype: DType, shape: Vec<u64>, values: &[T], put: impl Fn(&T, &mut Vec<u8>)) -> Tensor {
        assert_eq!(numel(&shape), Some(values.len() as u64), "values disagree with shape");
        let mut out = Vec::with_capacity(values.len() * dtype.size());
        values.iter().for_each(|v| put(v, &mut out));
        Tensor { dtype, shape, data: Bytes::from(out) }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    pub fn numel(&self) -> u64 {
        numel(&self.shape).unwrap_or(0)
    }

    pub fn bytes(&self) -> &Bytes {
        &self.data
    }

    /// Every element as i64, for integer and bool tensors (shape computations, axes, pads).
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        if self.dtype.is_float() {
            return None;
        }
        Some(self.elements().map(|v| v as i64).collect())
    }

    /// Every element as f64 (exact for every dtype but the largest 64-bit integers).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        self.elements().collect()
    }

    /// The tensor converted to `to` (rounding to nearest even; saturating for integers).
    pub fn to_dtype(&self, to: DType) -> Tensor {
        let mut out = Vec::with_capacity(self.numel() as usize * to.size());
        self.elements().for_each(|v| encode_f64(to, v, &mut out));
        Tensor { dtype: to, shape: self.shape.clone(), data: Bytes::from(out) }
    }

    /// Every element as f64, without allocating.
    pub fn values(&self) -> impl Iterator<Item = f64> + '_ {
        self.elements()
    }

    fn elements(&self) -> impl Iterator<Item = f64> + '_ {
        let dtype = self.dtype;
        self.data.chunks_exact(dtype.size()).map(move |c| decode_f64(dtype, c))
    }
}

fn numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
}

pub(crate) fn decode_f64(dtype: DType, c: &[u8]) -> f64 {
    // `c` has exactly `dtype.size()` bytes (chunks_exact), so the conversions cannot fail.
    let a2 = |c: &[u8]| [c[0], c[1]];
    let a4 = |c: &[u8]| [c[0], c[1], c[2], c[3]];
    let a8 = |c: &[u8]| [c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]];
    match dtype {
        DType::F32 => f32::from_le_bytes(a4(c)) as f64,
        DType::F16 => f16::from_le_bytes(a2(c)).to_f64(),
        DType::BF16 => bf16::from_le_bytes(a2(c)).to_f64(),
        DType::F64 => f64::from_le_bytes(a8(c)),
        DType::I64 => i64::from_le_bytes(a8(c)) as f64,
        DType::I32 => i32::from_le_bytes(a4(c)) as f64,
        DType::I16 => i16::from_le_bytes(a2(c)) as f64,
        DType::I8 => c[0] as i8 as f64,
        DType::U64 => u64::from_le_bytes(a8(c)) as f64,
        DType::U32 => u32::from_le_bytes(a4(c)) as f64,
        DType::U16 => u16::from_le_bytes(a2(c)) as f64,
        DType::U8 => c[0] as f64,
        DType::Bool => (c[0] != 0) as u8 as f64,
    }
}

/// Appends `v` converted to `dtype` (saturating `as` casts for integers).
pub(crate) fn encode_f64(dtype: DType, v: f64, out: &mut Vec<u8>) {
    match dtype {
        DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
        DType::F16 => out.extend_from_slice(&f16::from_f64(v).to_le_bytes()),
        DType::BF16 => out.extend_from_slice(&bf16::from_f64(v).to_le_bytes()),
        DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
        DType::I64 => out.extend_from_slice(&(v as i64).to_le_bytes()),
        DType::I32 => out.extend_from_slice(&(v as i32).to_le_bytes()),
        DType::I16 => out.extend_from_slice(&(v as i16).to_le_bytes()),
        DType::I8 => out.push(v as i8 as u8),
        DType::U64 => out.extend_from_slice(&(v as u64).to_le_bytes()),
        DType::U32 => out.extend_from_slice(&(v as u32).to_le_bytes()),
        DType::U16 => out.extend_from_slice(&(v as u16).to_le_bytes()),
        DType::U8 => out.push(v as u8),
        DType::Bool => out.push((v != 0.0) as u8),
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({}{:?}, {} bytes)", self.dtype, self.shape, self.data.len())
    }
}

/// Serde form: data as lowercase hex, lossless and compact enough for constant attributes.
#[derive(Serialize, Deserialize)]
struct TensorRepr {
    dtype: DType,
    shape: Vec<u64>,
    hex: String,
}

impl From<Tensor> for TensorRepr {
    fn from(t: Tensor) -> TensorRepr {
        let hex = t.data.iter().map(|b| format!("{b:02x}")).collect();
        TensorRepr { dtype: t.dtype, shape: t.shape, hex }
    }
}

impl TryFrom<TensorRepr> for Tensor {
    type Error = String;
    fn try_from(r: TensorRepr) -> Result<Tensor, String> {
        let data = crate::text::decode_hex(&r.hex)?;
        Tensor::from_bytes(r.dtype, r.shape, Bytes::from(data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn length_must_match_shape() {
        let err = Tensor::from_bytes(DType::F32, vec![2, 3], Bytes::from(vec![0u8; 20])).unwrap_err();
        assert!(err.contains("24 bytes expected"), "{err}");
        assert!(Tensor::from_bytes(DType::F16, vec![2, 3], Bytes::from(vec![0u8; 12])).is_ok());
    }

    #[test]
    fn typed_views() {
        let t = Tensor::from_f64_as(DType::F16, vec![3], &[1.0, -2.5, 65504.0]);
        assert_eq!(t.to_f64_vec(), vec![1.0, -2.5, 65504.0]);
        assert_eq!(t.to_i64_vec(), None);
        let i = Tensor::from_i64(vec![2], &[-1, 7]);
        assert_eq!(i.to_i64_vec(), Some(vec![-1, 7]));
    }

    #[test]
    fn serde_is_lossless() {
        let t = Tensor::from_f32(vec![2], &[1.5, f32::MIN_POSITIVE]);
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(serde_json::from_str::<Tensor>(&json).unwrap(), t);
    }
}

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

    /// An f32 tensor converted to f16 or bf16 (round to nearest even), with what the conversion lost.
    /// Works in blocks with the hardware conversion where the CPU has one: this is the hot loop of
    /// converting a model's weights.
    pub fn narrow(&self, to: DType) -> Option<(Tensor, Narrowing)> {
        if self.dtype != DType::F32 || !matches!(to, DType::F16 | DType::BF16) {
            return None;
        }
        let n = self.data.len() / 4;
        let mut out: Vec<u16> = vec![0; n];
        // Large weights are split across threads (each part is independent).
        const PER_THREAD: usize = 1 << 20;
        let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).min(n / PER_THREAD).max(1);
        let part = n.div_ceil(threads);
        let reports: Vec<Narrowing> = std::thread::scope(|s| {
            let jobs: Vec<_> = self
                .data
                .chunks(part * 4)
                .zip(out.chunks_mut(part))
                .map(|(src, dst)| s.spawn(move || narrow_part(src, dst, to)))
                .collect();
            jobs.into_iter().map(|j| j.join().unwrap_or_default()).collect()
        });
        let mut report = Narrowing::default();
        for r in reports {
            report.overflow = report.overflow.or(r.overflow);
            report.example_flushed = report.example_flushed.or(r.example_flushed);
            report.flushed += r.flushed;
            report.nonzero += r.nonzero;
        }
        let data = if cfg!(target_endian = "little") {
            Bytes::from_owner(U16Bytes(out))
        } else {
            Bytes::from(out.iter().flat_map(|b| b.to_le_bytes()).collect::<Vec<u8>>())
        };
        Some((Tensor { dtype: to, shape: self.shape.clone(), data }, report))
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

/// Converts little-endian f32 bytes in `src` to f16/bf16 bits in `dst`, block by block.
fn narrow_part(src: &[u8], dst: &mut [u16], to: DType) -> Narrowing {
    use half::slice::HalfFloatSliceExt;
    const BLOCK: usize = 4096;
    let mut report = Narrowing::default();
    let mut buf = [0f32; BLOCK];
    let inf = if to == DType::F16 { 0x7c00u16 } else { 0x7f80 };
    for (block, dst) in src.chunks(BLOCK * 4).zip(dst.chunks_mut(BLOCK)) {
        let n = dst.len();
        for (x, c) in buf.iter_mut().zip(block.chunks_exact(4)) {
            *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        let src = &buf[..n];
        // SAFETY: f16 and bf16 are `repr(transparent)` over u16, so the slice may be viewed as either.
        if to == DType::F16 {
            let d: &mut [f16] = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast(), n) };
            d.convert_from_f32_slice(src);
        } else {
            let d: &mut [bf16] = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast(), n) };
            d.convert_from_f32_slice(src);
        }
        // Counts vectorise; the element-wise look happens only in a block where conversion made a
        // zero or an infinity that the input did not have.
        let zeros_in = src.iter().filter(|&&x| x == 0.0).count();
        let infs_in = src.iter().filter(|&&x| x.is_infinite()).count();
        let zeros_out = dst.iter().filter(|&&b| b & 0x7fff == 0).count();
        let infs_out = dst.iter().filter(|&&b| b & 0x7fff == inf).count();
        report.nonzero += n - zeros_in;
        if zeros_out != zeros_in || infs_out != infs_in {
            for (&x, &b) in src.iter().zip(dst.iter()) {
                let mag = b & 0x7fff;
                if x != 0.0 && mag == 0 && x.is_finite() {
                    report.flushed += 1;
                    report.example_flushed.get_or_insert(x);
                }
                if mag == inf && x.is_finite() {
                    report.overflow.get_or_insert(x);
                }
            }
        }
    }
    report
}

/// A `Vec<u16>` seen as its little-endian bytes, so that converted data becomes a [`Bytes`]
/// without a copy.
struct U16Bytes(Vec<u16>);

impl AsRef<[u8]> for U16Bytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: any u16 slice is a valid u8 slice of twice the length (u8 has alignment 1), and
        // the caller only uses this on little-endian targets, where the byte order is the file's.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast(), self.0.len() * 2) }
    }
}

/// What converting a tensor to a narrower float type lost.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Narrowing {
    /// The first finite value that became infinite.
    pub overflow: Option<f32>,
    /// Non-zero values that became zero, and one of them.
    pub flushed: usize,
    pub example_flushed: Option<f32>,
    pub nonzero: usize,
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

/// `v` rounded to the nearest f16 (ties to even). `half`'s own `f16::from_f64` drops the low 32
/// bits of the mantissa before rounding, so a value just above a tie can round down.
pub fn f16_from_f64(v: f64) -> f16 {
    f16::from_f32(f32_rounded_to_odd(v))
}

/// `v` rounded to the nearest bf16 (ties to even); see [`f16_from_f64`].
pub fn bf16_from_f64(v: f64) -> bf16 {
    bf16::from_f32(f32_rounded_to_odd(v))
}

/// `v` as f32, an inexact result replaced by its odd neighbour on `v`'s side: rounding that to
/// a narrower type then rounds as `v` itself would (the classic fix for double rounding).
fn f32_rounded_to_odd(v: f64) -> f32 {
    let f = v as f32;
    if !f.is_finite() || f as f64 == v || f.to_bits() & 1 == 1 {
        return f;
    }
    let b = f.to_bits();
    f32::from_bits(if v.abs() > (f as f64).abs() { b + 1 } else { b - 1 })
}

/// Appends `v` converted to `dtype` (saturating `as` casts for integers).
pub(crate) fn encode_f64(dtype: DType, v: f64, out: &mut Vec<u8>) {
    match dtype {
        DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
        DType::F16 => out.extend_from_slice(&f16_from_f64(v).to_le_bytes()),
        DType::BF16 => out.extend_from_slice(&bf16_from_f64(v).to_le_bytes()),
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
    fn narrowing_reports_overflow_and_flushed_values() {
        let t = Tensor::from_f32(vec![5], &[1.0, -1e9, 1e-12, 0.0, 65504.0]);
        let (n, r) = t.narrow(DType::F16).unwrap();
        assert_eq!(n.to_f64_vec()[0], 1.0);
        assert_eq!(n.to_f64_vec()[4], 65504.0);
        assert_eq!(r.overflow, Some(-1e9));
        assert_eq!((r.flushed, r.nonzero), (1, 4));
        let (_, r) = t.narrow(DType::BF16).unwrap();
        assert_eq!((r.overflow, r.flushed), (None, 0));
        // Many blocks: the result equals element-wise conversion.
        let v: Vec<f32> = (0..10_000).map(|i| (i as f32 - 5000.0) * 0.37).collect();
        let (n, _) = Tensor::from_f32(vec![10_000], &v).narrow(DType::F16).unwrap();
        assert_eq!(n, Tensor::from_f32(vec![10_000], &v).to_dtype(DType::F16));
    }

    #[test]
    fn rounding_from_f64_is_to_nearest_even() {
        // Just above a tie rounds up; the tie itself goes to the even neighbour.
        let tiny = 2f64.powi(-40);
        assert_eq!(bf16_from_f64(1.0 + 2f64.powi(-8) + tiny).to_f64(), 1.0 + 2f64.powi(-7));
        assert_eq!(bf16_from_f64(1.0 + 2f64.powi(-8)).to_f64(), 1.0);
        assert_eq!(bf16_from_f64(-(1.0 + 2f64.powi(-8) + tiny)).to_f64(), -(1.0 + 2f64.powi(-7)));
        assert_eq!(f16_from_f64(1.0 + 2f64.powi(-11) + tiny).to_f64(), 1.0 + 2f64.powi(-10));
        assert_eq!(f16_from_f64(1.0 + 2f64.powi(-11)).to_f64(), 1.0);
        assert_eq!(f16_from_f64(2f64.powi(-25) + tiny * 2f64.powi(-30)).to_f64(), 2f64.powi(-24));
        assert_eq!(f16_from_f64(65520.0 - 2f64.powi(-30)).to_f64(), 65504.0);
        assert!(f16_from_f64(65520.0).is_infinite() && bf16_from_f64(f64::MAX).is_infinite());
        assert!(f16_from_f64(f64::NAN).is_nan() && bf16_from_f64(f64::NAN).is_nan());
        // Every f32 converts as the f32 conversion does (which is exact in hardware).
        let mut seed = 7u64;
        for _ in 0..100_000 {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let x = f32::from_bits((seed >> 32) as u32);
            let (h, b) = (f16_from_f64(x as f64), bf16_from_f64(x as f64));
            assert!(h.to_bits() == f16::from_f32(x).to_bits() || x.is_nan(), "{x:e}");
            assert!(b.to_bits() == bf16::from_f32(x).to_bits() || x.is_nan(), "{x:e}");
        }
    }

    #[test]
    fn serde_is_lossless() {
        let t = Tensor::from_f32(vec![2], &[1.5, f32::MIN_POSITIVE]);
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(serde_json::from_str::<Tensor>(&json).unwrap(), t);
    }
}

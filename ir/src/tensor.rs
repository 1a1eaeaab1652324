//! Tensors with data: initializers and constant attributes.
//!
//! Data is little-endian bytes in a reference-counted [`Bytes`] buffer. An initializer decoded from a
//! model file shares the file's buffer (no copy), and cloning a tensor is cheap, which is what keeps
//! import + export of a large model within a small multiple of its file size.
//!
//! A weight narrowed to f16/bf16 ([`Tensor::narrow`]) is judged at once but converted only when its
//! data is first read; the ONNX writer converts it piece by piece on its way to the file
//! ([`ConvertAhead`]), so compiling a model never holds a second copy of its weights.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use crate::DType;

/// A dense tensor: dtype, static shape, little-endian data.
#[derive(Clone, Serialize, Deserialize)]
#[serde(into = "TensorRepr", try_from = "TensorRepr")]
pub struct Tensor {
    dtype: DType,
    shape: Vec<u64>,
    data: Data,
}

#[derive(Clone)]
enum Data {
    Bytes(Bytes),
    /// f32 data to be converted to the tensor's 16-bit dtype, and the conversion once made.
    Narrowed(Arc<(Bytes, OnceLock<Bytes>)>),
}

impl PartialEq for Tensor {
    fn eq(&self, other: &Tensor) -> bool {
        self.dtype == other.dtype && self.shape == other.shape && self.bytes() == other.bytes()
    }
}

impl Eq for Tensor {}

impl Hash for Tensor {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.dtype.hash(state);
        self.shape.hash(state);
        self.bytes().hash(state);
    }
}

impl Tensor {
    /// A tensor over `data`; errors when the byte length disagrees with the shape. A bool byte
    /// other than 0 is true, stored as 1 (a file's raw bytes may hold any non-zero value), so
    /// that every reader of the bytes, a device among them, sees 0 or 1.
    pub fn from_bytes(dtype: DType, shape: Vec<u64>, data: Bytes) -> Result<Tensor, String> {
        let numel = numel(&shape).ok_or("element count overflows")?;
        let want = numel.checked_mul(dtype.size() as u64).ok_or("byte count overflows")?;
        if data.len() as u64 != want {
            return Err(format!("{} bytes of data for {dtype}{:?} ({want} bytes expected)", data.len(), shape));
        }
        let data = if dtype == DType::Bool && data.iter().any(|&b| b > 1) {
            data.iter().map(|&b| u8::from(b != 0)).collect::<Vec<u8>>().into()
        } else {
            data
        };
        Ok(Tensor { dtype, shape, data: Data::Bytes(data) })
    }

    /// A tensor of zeros (all bytes 0: +0 in every float dtype, 0 in every integer one), without
    /// converting a value per element; the bytes are the allocator's zeroed pages until written.
    pub fn zeros(dtype: DType, shape: Vec<u64>) -> Tensor {
        let bytes = numel(&shape).unwrap_or(0) as usize * dtype.size();
        Tensor { dtype, shape, data: Data::Bytes(Bytes::from(vec![0u8; bytes])) }
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
        Tensor { dtype, shape, data: Data::Bytes(Bytes::from(out)) }
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

    /// The data as little-endian bytes (a narrowed tensor is converted on the first call).
    pub fn bytes(&self) -> &Bytes {
        match &self.data {
            Data::Bytes(b) => b,
            Data::Narrowed(n) => n.1.get_or_init(|| convert(&n.0, self.dtype)),
        }
    }

    /// Whether every element equals the first as a value (NaN equals nothing; +0 and -0 are
    /// equal): the same bytes throughout, or zeros of either sign. A fresh model's norm scales and
    /// biases are such tensors.
    pub fn all_equal(&self) -> bool {
        let (size, bytes) = (self.dtype().size(), self.bytes());
        let first = self.values().next();
        if bytes.chunks_exact(size).all(|e| e == &bytes[..size]) {
            return first.is_some_and(|x| !x.is_nan());
        }
        first == Some(0.0) && self.values().all(|x| x == 0.0)
    }

    /// Whether the two hold the same elements in the same dtype and shape. Two tensors narrowed
    /// from the same source compare without converting either (two narrowed from different
    /// sources that round to the same values compare unequal).
    pub fn same_data(&self, other: &Tensor) -> bool {
        if self.dtype != other.dtype || self.shape != other.shape {
            return false;
        }
        match (self.narrowed_from(), other.narrowed_from()) {
            (Some(a), Some(b)) => a == b,
            (None, None) => self.bytes() == other.bytes(),
            _ => false,
        }
    }

    /// The length of [`Tensor::bytes`], without converting a narrowed tensor.
    pub fn byte_len(&self) -> usize {
        match &self.data {
            Data::Bytes(b) => b.len(),
            Data::Narrowed(n) => n.0.len() / 4 * self.dtype.size(),
        }
    }

    /// Hands the data to `put` in order, in pieces: a narrowed tensor that nothing has read yet is
    /// converted a piece at a time, so writing it out never holds it whole ([`ConvertAhead`]'s way
    /// for a tensor it was not given).
    pub fn for_each_piece<E>(&self, mut put: impl FnMut(&[u8]) -> Result<(), E>) -> Result<(), E> {
        let Some(src) = self.pending() else { return put(self.bytes()) };
        let mut buf = vec![0u16; PIECE.min(src.len() / 4)];
        for piece in src.chunks(PIECE * 4) {
            let dst = &mut buf[..piece.len() / 4];
            convert_part(piece, dst, self.dtype);
            put(u16_bytes(dst))?;
        }
        Ok(())
    }

    /// The f32 source of a narrowed tensor whose conversion nothing has asked for yet.
    fn pending(&self) -> Option<&Bytes> {
        self.narrowed_from().filter(|_| matches!(&self.data, Data::Narrowed(n) if n.1.get().is_none()))
    }

    /// The f32 source of a narrowed tensor.
    fn narrowed_from(&self) -> Option<&Bytes> {
        match &self.data {
            Data::Narrowed(n) => Some(&n.0),
            Data::Bytes(_) => None,
        }
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
        Tensor { dtype: to, shape: self.shape.clone(), data: Data::Bytes(Bytes::from(out)) }
    }

    /// An f32 tensor converted to f16 or bf16 (round to nearest even), with what the conversion
    /// loses. The loss is measured now; the conversion is made when the data is first read (see
    /// the module's documentation).
    pub fn narrow(&self, to: DType) -> Option<(Tensor, Narrowing)> {
        Tensor::narrow_all(&[self], to).pop().flatten()
    }

    /// [`Tensor::narrow`] of each tensor, measured on all threads at once (a model's weights are
    /// many tensors, most of them too small to split).
    pub fn narrow_all(ts: &[&Tensor], to: DType) -> Vec<Option<(Tensor, Narrowing)>> {
        let ok = |t: &Tensor| t.dtype == DType::F32 && matches!(to, DType::F16 | DType::BF16);
        // (tensor, part of its bytes), in order.
        let parts: Vec<(usize, &[u8])> = ts
            .iter()
            .enumerate()
            .filter(|(_, t)| ok(t))
            .flat_map(|(i, t)| t.bytes().chunks(PIECE * 4).map(move |p| (i, p)))
            .collect();
        let judged = par_map(&parts, |&(_, p)| judge_part(p, to));
        let mut reports: Vec<Narrowing> = vec![Narrowing::default(); ts.len()];
        for (&(i, _), r) in parts.iter().zip(judged) {
            let a = &mut reports[i];
            a.overflow = a.overflow.or(r.overflow);
            a.example_flushed = a.example_flushed.or(r.example_flushed);
            a.flushed += r.flushed;
            a.nonzero += r.nonzero;
        }
        ts.iter()
            .zip(reports)
            .map(|(t, report)| {
                ok(t).then(|| {
                    let data = Data::Narrowed(Arc::new((t.bytes().clone(), OnceLock::new())));
                    (Tensor { dtype: to, shape: t.shape.clone(), data }, report)
                })
            })
            .collect()
    }

    /// Every element as f64, without allocating.
    pub fn values(&self) -> impl Iterator<Item = f64> + '_ {
        self.elements()
    }

    fn elements(&self) -> impl Iterator<Item = f64> + '_ {
        let dtype = self.dtype;
        self.bytes().chunks_exact(dtype.size()).map(move |c| decode_f64(dtype, c))
    }
}

/// Weights are judged, converted and written in pieces of this many elements (enough to keep a
/// thread busy; small enough to spread a model's weights over the threads).
const PIECE: usize = 1 << 18;

/// Narrowed tensors converted ahead of a writer, on a second thread of a scope, in the order the
/// writer takes them: while the writer hands one piece to the file system the next ones are
/// being converted (on ResNet-18 writing 23 MB takes about as long as converting it).
pub struct ConvertAhead<'t> {
    /// The tensors whose data was pending when converting started; the next one is `next`.
    ts: Vec<&'t Tensor>,
    next: usize,
    full: std::sync::mpsc::Receiver<Vec<u16>>,
    empty: std::sync::mpsc::Sender<Vec<u16>>,
}

impl<'t> ConvertAhead<'t> {
    /// Starts converting, in order, those of `ts` whose data is pending. The thread stops when
    /// the list is done or the [`ConvertAhead`] is dropped.
    pub fn start<'scope>(scope: &'scope std::thread::Scope<'scope, '_>, ts: &[&'t Tensor]) -> ConvertAhead<'t>
    where
        't: 'scope,
    {
        let ts: Vec<&Tensor> = ts.iter().copied().filter(|t| t.pending().is_some()).collect();
        // Four buffers go round: one being converted, one being written, two ready.
        let (full_tx, full) = std::sync::mpsc::sync_channel::<Vec<u16>>(2);
        let (empty, empty_rx) = std::sync::mpsc::channel::<Vec<u16>>();
        for _ in 0..4 {
            empty.send(Vec::with_capacity(PIECE)).expect("the receiver is alive");
        }
        if ts.is_empty() {
            return ConvertAhead { ts, next: 0, full, empty };
        }
        let work = ts.clone();
        scope.spawn(move || {
            for (src, to) in work.iter().filter_map(|t| Some((t.narrowed_from()?, t.dtype))) {
                for piece in src.chunks(PIECE * 4) {
                    // Either channel closes only when the writer is gone.
                    let Ok(mut buf) = empty_rx.recv() else { return };
                    buf.resize(piece.len() / 4, 0);
                    convert_part(piece, &mut buf, to);
                    if full_tx.send(buf).is_err() {
                        return;
                    }
                }
            }
        });
        ConvertAhead { ts, next: 0, full, empty }
    }

    /// Hands `t`'s data to `put` in pieces: converted ahead when `t` is the next tensor of the
    /// list, else converted here a piece at a time.
    pub fn put_data<E>(&mut self, t: &Tensor, mut put: impl FnMut(&[u8]) -> Result<(), E>) -> Result<(), E> {
        if !self.ts.get(self.next).is_some_and(|n| std::ptr::eq(*n, t)) {
            return t.for_each_piece(put);
        }
        self.next += 1;
        // As many pieces as the converter made of it (whether or not it was converted since).
        let pieces = t.narrowed_from().map_or(0, |src| src.len().div_ceil(PIECE * 4));
        for _ in 0..pieces {
            let buf = self.full.recv().expect("the converter runs until the list is done");
            put(u16_bytes(&buf))?;
            let _ = self.empty.send(buf);
        }
        Ok(())
    }
}

/// `f` of each item, on every thread when there is more than one item (the threads take the next
/// item in turn); the results in the items' order.
fn par_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static THREADS: OnceLock<usize> = OnceLock::new();
    let threads = *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(1, |t| t.get()));
    let threads = threads.min(items.len());
    if threads <= 1 {
        return items.iter().map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let work = || {
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = items.get(i) else { return done };
            done.push((i, f(item)));
        }
    };
    let mut done: Vec<(usize, R)> = std::thread::scope(|s| {
        let helpers: Vec<_> = (1..threads).map(|_| s.spawn(work)).collect();
        let mut done = work();
        for h in helpers {
            done.extend(h.join().expect("a conversion thread panicked"));
        }
        done
    });
    done.sort_unstable_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

/// All of the f32 bytes `src` converted to `to` (f16 or bf16).
fn convert(src: &Bytes, to: DType) -> Bytes {
    let mut out: Vec<u16> = vec![0; src.len() / 4];
    // Each piece's output behind a lock that no two threads ever contend for.
    let parts: Vec<(&[u8], std::sync::Mutex<&mut [u16]>)> =
        src.chunks(PIECE * 4).zip(out.chunks_mut(PIECE)).map(|(s, d)| (s, d.into())).collect();
    par_map(&parts, |(src, dst)| convert_part(src, &mut dst.lock().expect("not poisoned"), to));
    drop(parts);
    Bytes::from_owner(U16Bytes(out))
}

const BLOCK: usize = 4096;

/// Converts little-endian f32 bytes in `src` to f16/bf16 bits in `dst` (little-endian on return).
fn convert_part(src: &[u8], dst: &mut [u16], to: DType) {
    let mut buf = [0f32; BLOCK];
    for (block, dst) in src.chunks(BLOCK * 4).zip(dst.chunks_mut(BLOCK)) {
        convert_block(load_block(block, &mut buf), dst, to);
    }
}

/// Up to [`BLOCK`] little-endian f32 values read into `buf`.
fn load_block<'b>(block: &[u8], buf: &'b mut [f32; BLOCK]) -> &'b [f32] {
    let n = block.len() / 4;
    for (x, c) in buf.iter_mut().zip(block.chunks_exact(4)) {
        *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    &buf[..n]
}

/// `src` converted to f16/bf16 bits in `dst` (little-endian).
fn convert_block(src: &[f32], dst: &mut [u16], to: DType) {
    use half::slice::HalfFloatSliceExt;
    let n = dst.len();
    // SAFETY: f16 and bf16 are `repr(transparent)` over u16, so the slice may be viewed as either.
    if to == DType::F16 {
        let d: &mut [f16] = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast(), n) };
        d.convert_from_f32_slice(src);
    } else {
        let d: &mut [bf16] = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast(), n) };
        d.convert_from_f32_slice(src);
    }
    if cfg!(target_endian = "big") {
        dst.iter_mut().for_each(|b| *b = b.to_le());
    }
}

/// What converting the f32 bytes `src` to `to` loses, without keeping the conversion.
fn judge_part(src: &[u8], to: DType) -> Narrowing {
    // What conversion loses lies at the two ends of the magnitude range (f32 bits without the
    // sign): a non-zero magnitude at or below `tiny` may round to zero, one at or above `huge`
    // to infinity. Only a block holding either is converted and looked at element by element.
    let (tiny, huge, inf) = match to {
        DType::F16 => (0x3300_0000, 0x477f_f000, 0x7c00u16), // 2^-25, 65520
        _ => (0x0000_8000, 0x7f7f_8000, 0x7f80),
    };
    let mut report = Narrowing::default();
    let mut buf = [0f32; BLOCK];
    let mut out = [0u16; BLOCK];
    for block in src.chunks(BLOCK * 4) {
        let (nonzero, suspect) = scan(block, tiny, huge);
        report.nonzero += nonzero as usize;
        if !suspect {
            continue;
        }
        let xs = load_block(block, &mut buf);
        let dst = &mut out[..xs.len()];
        convert_block(xs, dst, to);
        for (&x, &b) in xs.iter().zip(dst.iter()) {
            let mag = u16::from_le(b) & 0x7fff;
            if x != 0.0 && mag == 0 && x.is_finite() {
                report.flushed += 1;
                report.example_flushed.get_or_insert(x);
            }
            if mag == inf && x.is_finite() {
                report.overflow.get_or_insert(x);
            }
        }
    }
    report
}

/// `u16`s seen as bytes (little-endian ones, on every target, after [`convert_block`]).
fn u16_bytes(xs: &[u16]) -> &[u8] {
    // SAFETY: any u16 slice is a valid u8 slice of twice the length (u8 has alignment 1).
    unsafe { std::slice::from_raw_parts(xs.as_ptr().cast(), xs.len() * 2) }
}

/// The number of non-zero values among the little-endian f32 bytes `xs`, and whether any has a
/// magnitude (f32 bits without the sign) at or below `tiny` or at or above `huge`. One pass of
/// compares in 32-bit lanes straight from the bytes, so it vectorises (in AVX2's wider lanes
/// where the CPU has them).
fn scan(xs: &[u8], tiny: i32, huge: i32) -> (u32, bool) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        #[target_feature(enable = "avx2")]
        unsafe fn scan_avx2(xs: &[u8], tiny: i32, huge: i32) -> (u32, bool) {
            scan_lanes(xs, tiny, huge)
        }
        // SAFETY: the CPU has AVX2.
        return unsafe { scan_avx2(xs, tiny, huge) };
    }
    scan_lanes(xs, tiny, huge)
}

#[inline(always)]
fn scan_lanes(xs: &[u8], tiny: i32, huge: i32) -> (u32, bool) {
    let (mut nonzero, mut suspect) = (0u32, 0u32);
    for c in xs.chunks_exact(4) {
        let mag = (u32::from_le_bytes(c.try_into().expect("4 bytes")) & 0x7fff_ffff) as i32;
        let nz = (mag > 0) as u32;
        nonzero += nz;
        suspect |= (mag >= huge) as u32 | (nz & (mag <= tiny) as u32);
    }
    (nonzero, suspect != 0)
}

/// A `Vec<u16>` (of little-endian values) seen as bytes, so that converted data becomes a
/// [`Bytes`] without a copy.
struct U16Bytes(Vec<u16>);

impl AsRef<[u8]> for U16Bytes {
    fn as_ref(&self) -> &[u8] {
        u16_bytes(&self.0)
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
        write!(f, "Tensor({}{:?}, {} bytes)", self.dtype, self.shape, self.byte_len())
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
        let hex = t.bytes().iter().map(|b| format!("{b:02x}")).collect();
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
    fn bool_bytes_are_zero_or_one() {
        let t = Tensor::from_bytes(DType::Bool, vec![4], Bytes::from(vec![0u8, 1, 7, 255])).unwrap();
        assert_eq!(t.bytes().as_ref(), [0, 1, 1, 1]);
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

    /// What narrowing loses, counted element by element from the exact conversion.
    fn lost(v: &[f32], to: DType) -> (Option<f32>, usize, usize) {
        let (mut overflow, mut flushed) = (None, 0);
        for &x in v.iter().filter(|x| x.is_finite()) {
            let y = if to == DType::F16 { f16::from_f32(x).to_f64() } else { bf16::from_f32(x).to_f64() };
            if y.is_infinite() {
                overflow.get_or_insert(x);
            }
            flushed += (x != 0.0 && y == 0.0) as usize;
        }
        (overflow, flushed, v.iter().filter(|&&x| x != 0.0).count())
    }

    #[test]
    fn narrowing_judges_the_edges_of_the_range_exactly() {
        // Values next to where f16 and bf16 overflow or flush, scattered one per 4096-element
        // block among ordinary values (the blocks in between are judged without converting).
        let edges: Vec<f32> = [65504.0f32, 65519.996, 65520.0, 2f32.powi(-24), 2f32.powi(-25), f32::MAX]
            .into_iter()
            .chain([f32::from_bits(0x3300_0001), f32::from_bits(0x7f7f_7fff), f32::from_bits(0x7f7f_8000)])
            .chain([f32::from_bits(0x8000), f32::from_bits(0x7fff), f32::from_bits(1), f32::INFINITY, f32::NAN])
            .flat_map(|x| [x, -x])
            .collect();
        let mut seed = 12345u64;
        for (i, &edge) in edges.iter().enumerate() {
            let mut v: Vec<f32> = (0..3 * 4096)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 100.0
                })
                .collect();
            v[4096 + i * 97] = edge;
            let t = Tensor::from_f32(vec![v.len() as u64], &v);
            for to in [DType::F16, DType::BF16] {
                let (n, r) = t.narrow(to).unwrap();
                assert_eq!((r.overflow, r.flushed, r.nonzero), lost(&v, to), "{edge:e} to {to}");
                assert_eq!(n, t.to_dtype(to), "{edge:e} to {to}");
            }
        }
    }

    #[test]
    fn narrowed_data_streams_in_pieces_equal_to_the_whole() {
        // Long enough to go through the converter thread (more than two pieces).
        let v: Vec<f32> = (0..1_100_001).map(|i| (i as f32).sin() * 70_000.0).collect();
        let t = Tensor::from_f32(vec![v.len() as u64], &v);
        let (n, r) = t.narrow(DType::F16).unwrap();
        assert!(r.overflow.is_some());
        let mut streamed = Vec::new();
        let keep = |p: &[u8]| {
            streamed.extend_from_slice(p);
            Ok::<_, ()>(())
        };
        n.for_each_piece(keep).unwrap();
        assert!(n.pending().is_some(), "streaming must not convert the whole tensor");
        assert_eq!(streamed.len(), n.byte_len());
        assert_eq!(&streamed[..], &n.bytes()[..]);
        assert_eq!(n, t.to_dtype(DType::F16));
        // A failing writer stops the stream (and its converter) at once.
        let (n, _) = t.narrow(DType::BF16).unwrap();
        let mut calls = 0;
        let full = |_: &[u8]| {
            calls += 1;
            Err("disk full")
        };
        assert_eq!(n.for_each_piece(full), Err("disk full"));
        assert_eq!(calls, 1);
        // Converted ahead on a second thread: pieces equal to the whole, tensors not in the list
        // or taken out of order still come out right, and a writer that fails stops it.
        let small = Tensor::from_f32(vec![3], &[1.0, 2.0, 3.0]);
        let (a, b, c) = (t.narrow(DType::F16).unwrap().0, small.narrow(DType::BF16).unwrap().0, t.clone());
        let (late, _) = t.narrow(DType::BF16).unwrap();
        std::thread::scope(|s| {
            let mut ahead = ConvertAhead::start(s, &[&a, &c, &b, &late]);
            for x in [&a, &b, &small, &c, &late] {
                let mut out = Vec::new();
                let keep = |p: &[u8]| {
                    out.extend_from_slice(p);
                    Ok::<_, ()>(())
                };
                ahead.put_data(x, keep).unwrap();
                assert_eq!(&out[..], &x.bytes()[..]);
            }
        });
        let (a, _) = t.narrow(DType::F16).unwrap();
        std::thread::scope(|s| {
            let mut ahead = ConvertAhead::start(s, &[&a, &a, &a]);
            assert_eq!(ahead.put_data(&a, |_| Err("disk full")), Err("disk full"));
        });
        // Many tensors at once judge as one at a time.
        let ts = [&t, &Tensor::from_f32(vec![2], &[1e-30, 1.0]), &Tensor::from_i64(vec![1], &[3])];
        let all = Tensor::narrow_all(&ts, DType::F16);
        assert_eq!(all.len(), 3);
        for (t, r) in ts.iter().zip(all) {
            assert_eq!(r.map(|r| r.1), t.narrow(DType::F16).map(|r| r.1));
        }
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

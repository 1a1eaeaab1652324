//! Host tensors: typed storage, FP16/BF16 kept as half.

use half::{bf16, f16};
use mpc_ir::{DType, Tensor};

/// Element storage, one variant per dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F32(Elems<f32>),
    F16(Elems<f16>),
    BF16(Elems<bf16>),
    F64(Elems<f64>),
    I64(Elems<i64>),
    I32(Elems<i32>),
    I16(Elems<i16>),
    I8(Elems<i8>),
    U64(Elems<u64>),
    U32(Elems<u32>),
    U16(Elems<u16>),
    U8(Elems<u8>),
    Bool(Elems<bool>),
}

/// A tensor's elements: owned, or a typed view of a device region's bytes that the CPU device
/// lends a kernel for the length of one launch ([`Elems::view`]). Either way they read as a
/// slice. A view never outlives its launch: cloning one copies its elements, and writing to one
/// (through `DerefMut`) first makes it an owned copy, so the region is never written through it.
pub struct Elems<T>(Repr<T>);

enum Repr<T> {
    Owned(Vec<T>),
    View { ptr: *const T, len: usize },
}

impl<T: Copy> Elems<T> {
    /// A view of `len` elements at `ptr`.
    ///
    /// # Safety
    /// `ptr` is aligned for `T` and points at `len` initialised values of `T` (every bit pattern
    /// there a valid `T`) that nothing writes, moves or frees while the view or any borrow of it
    /// lives.
    pub(crate) unsafe fn view(ptr: *const T, len: usize) -> Elems<T> {
        Elems(Repr::View { ptr, len })
    }

    /// Whether the elements are a view of a device region.
    pub fn is_view(&self) -> bool {
        matches!(self.0, Repr::View { .. })
    }
}

impl<T> std::ops::Deref for Elems<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.0 {
            Repr::Owned(v) => v,
            // SAFETY: the contract of `Elems::view`: aligned, initialised and unwritten while
            // the view lives.
            Repr::View { ptr, len } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }
}

impl<T: Copy> std::ops::DerefMut for Elems<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        if let Repr::View { .. } = self.0 {
            self.0 = Repr::Owned(self.to_vec());
        }
        match &mut self.0 {
            Repr::Owned(v) => v,
            Repr::View { .. } => unreachable!("a view was made owned above"),
        }
    }
}

impl<T> From<Vec<T>> for Elems<T> {
    fn from(v: Vec<T>) -> Elems<T> {
        Elems(Repr::Owned(v))
    }
}

impl<T> FromIterator<T> for Elems<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Elems<T> {
        Elems(Repr::Owned(iter.into_iter().collect()))
    }
}

impl<'a, T> IntoIterator for &'a Elems<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<T: Copy> Clone for Elems<T> {
    fn clone(&self) -> Elems<T> {
        Elems(Repr::Owned(self.to_vec()))
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Elems<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

impl<T: PartialEq> PartialEq for Elems<T> {
    fn eq(&self, other: &Elems<T>) -> bool {
        **self == **other
    }
}

// SAFETY: an owned `Elems` is a `Vec<T>` (Send with `T: Send`, Sync with `T: Sync`). A view is a
// shared borrow of memory that nothing writes while it lives (the contract of `Elems::view`):
// sending or sharing it is sharing a `&[T]`, which needs `T: Sync`.
unsafe impl<T: Send + Sync> Send for Elems<T> {}
unsafe impl<T: Sync> Sync for Elems<T> {}

/// A tensor in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Data,
}

/// Runs `$e` on the storage Vec whatever its element type.
macro_rules! each {
    ($data:expr, $v:ident => $e:expr) => {
        match $data {
            Data::F32($v) => $e,
            Data::F16($v) => $e,
            Data::BF16($v) => $e,
            Data::F64($v) => $e,
            Data::I64($v) => $e,
            Data::I32($v) => $e,
            Data::I16($v) => $e,
            Data::I8($v) => $e,
            Data::U64($v) => $e,
            Data::U32($v) => $e,
            Data::U16($v) => $e,
            Data::U8($v) => $e,
            Data::Bool($v) => $e,
        }
    };
}

impl HostTensor {
    pub fn dtype(&self) -> DType {
        match &self.data {
            Data::F32(_) => DType::F32,
            Data::F16(_) => DType::F16,
            Data::BF16(_) => DType::BF16,
            Data::F64(_) => DType::F64,
            Data::I64(_) => DType::I64,
            Data::I32(_) => DType::I32,
            Data::I16(_) => DType::I16,
            Data::I8(_) => DType::I8,
            Data::U64(_) => DType::U64,
            Data::U32(_) => DType::U32,
            Data::U16(_) => DType::U16,
            Data::U8(_) => DType::U8,
            Data::Bool(_) => DType::Bool,
        }
    }

    pub fn len(&self) -> usize {
        each!(&self.data, v => v.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the elements are a view of a device region's bytes (not a copy).
    pub fn is_view(&self) -> bool {
        each!(&self.data, v => v.is_view())
    }

    pub fn bytes(&self) -> usize {
        self.len() * self.dtype().size()
    }

    /// Float values widened to f32 (the compute type of f32, f16 and bf16); `None` for other dtypes.
    pub fn f32s(&self) -> Option<Vec<f32>> {
        match &self.data {
            Data::F32(v) => Some(v.to_vec()),
            Data::F16(v) => Some(v.iter().map(|x| x.to_f32()).collect()),
            Data::BF16(v) => Some(v.iter().map(|x| x.to_f32()).collect()),
            _ => None,
        }
    }

    /// Every value as f64 (exact for all but the largest 64-bit integers).
    pub fn f64s(&self) -> Vec<f64> {
        match &self.data {
            Data::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
            Data::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            Data::F64(v) => v.to_vec(),
            Data::Bool(v) => v.iter().map(|&x| x as u8 as f64).collect(),
            Data::I64(v) => v.iter().map(|&x| x as f64).collect(),
            Data::U64(v) => v.iter().map(|&x| x as f64).collect(),
            Data::I32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::U32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::I16(v) => v.iter().map(|&x| x as f64).collect(),
            Data::U16(v) => v.iter().map(|&x| x as f64).collect(),
            Data::I8(v) => v.iter().map(|&x| x as f64).collect(),
            Data::U8(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }

    /// Integer and bool values as i64 (shapes, indices, axes); `None` for floats.
    pub fn i64s(&self) -> Option<Vec<i64>> {
        Some(match &self.data {
            Data::I64(v) => v.to_vec(),
            Data::I32(v) => v.iter().map(|&x| x as i64).collect(),
            Data::I16(v) => v.iter().map(|&x| x as i64).collect(),
            Data::I8(v) => v.iter().map(|&x| x as i64).collect(),
            Data::U64(v) => v.iter().map(|&x| x as i64).collect(),
            Data::U32(v) => v.iter().map(|&x| x as i64).collect(),
            Data::U16(v) => v.iter().map(|&x| x as i64).collect(),
            Data::U8(v) => v.iter().map(|&x| x as i64).collect(),
            Data::Bool(v) => v.iter().map(|&x| x as i64).collect(),
            _ => return None,
        })
    }

    /// A tensor of `dtype` from f32 values, rounding on store (f16/bf16) as a GPU does.
    pub fn from_f32(dtype: DType, shape: Vec<usize>, v: Vec<f32>) -> HostTensor {
        let data = match dtype {
            DType::F32 => Data::F32(v.into()),
            DType::F16 => Data::F16(v.iter().map(|&x| f16::from_f32(x)).collect()),
            DType::BF16 => Data::BF16(v.iter().map(|&x| bf16::from_f32(x)).collect()),
            _ => return HostTensor::from_f64(dtype, shape, v.into_iter().map(|x| x as f64).collect()),
        };
        HostTensor { shape, data }
    }

    /// A tensor of `dtype` from f64 values (ONNX Cast semantics: floats round to nearest even,
    /// float → int truncates toward zero and saturates, anything → bool is `!= 0`).
    pub fn from_f64(dtype: DType, shape: Vec<usize>, v: Vec<f64>) -> HostTensor {
        let data = match dtype {
            DType::F32 => Data::F32(v.iter().map(|&x| x as f32).collect()),
            DType::F16 => Data::F16(v.iter().map(|&x| mpc_ir::f16_from_f64(x)).collect()),
            DType::BF16 => Data::BF16(v.iter().map(|&x| mpc_ir::bf16_from_f64(x)).collect()),
            DType::F64 => Data::F64(v.into()),
            DType::I64 => Data::I64(v.iter().map(|&x| x as i64).collect()),
            DType::I32 => Data::I32(v.iter().map(|&x| x as i32).collect()),
            DType::I16 => Data::I16(v.iter().map(|&x| x as i16).collect()),
            DType::I8 => Data::I8(v.iter().map(|&x| x as i8).collect()),
            DType::U64 => Data::U64(v.iter().map(|&x| x as u64).collect()),
            DType::U32 => Data::U32(v.iter().map(|&x| x as u32).collect()),
            DType::U16 => Data::U16(v.iter().map(|&x| x as u16).collect()),
            DType::U8 => Data::U8(v.iter().map(|&x| x as u8).collect()),
            DType::Bool => Data::Bool(v.iter().map(|&x| x != 0.0).collect()),
        };
        HostTensor { shape, data }
    }

    /// A tensor of `dtype` from i64 values (exact for integer dtypes).
    pub fn from_i64(dtype: DType, shape: Vec<usize>, v: Vec<i64>) -> HostTensor {
        let data = match dtype {
            DType::I64 => Data::I64(v.into()),
            DType::I32 => Data::I32(v.iter().map(|&x| x as i32).collect()),
            DType::I16 => Data::I16(v.iter().map(|&x| x as i16).collect()),
            DType::I8 => Data::I8(v.iter().map(|&x| x as i8).collect()),
            DType::U64 => Data::U64(v.iter().map(|&x| x as u64).collect()),
            DType::U32 => Data::U32(v.iter().map(|&x| x as u32).collect()),
            DType::U16 => Data::U16(v.iter().map(|&x| x as u16).collect()),
            DType::U8 => Data::U8(v.iter().map(|&x| x as u8).collect()),
            DType::Bool => Data::Bool(v.iter().map(|&x| x != 0).collect()),
            _ => return HostTensor::from_f64(dtype, shape, v.into_iter().map(|x| x as f64).collect()),
        };
        HostTensor { shape, data }
    }

    /// Converts to `dtype` (ONNX Cast), exactly between integer types.
    pub fn cast(&self, dtype: DType) -> HostTensor {
        if dtype == self.dtype() {
            return self.clone();
        }
        match (self.i64s(), dtype.is_float()) {
            (Some(v), false) => HostTensor::from_i64(dtype, self.shape.clone(), v),
            _ => HostTensor::from_f64(dtype, self.shape.clone(), self.f64s()),
        }
    }

    /// Elements picked by `index` (positions in the flat data), keeping the dtype.
    pub fn pick(&self, shape: Vec<usize>, index: &[usize]) -> HostTensor {
        HostTensor { shape, data: map_same!(&self.data, v => index.iter().map(|&i| v[i]).collect()) }
    }

    /// Elements read with `strides` (one per output dim, in elements) into a tensor of `shape`:
    /// transposes and broadcasts without an index table, the offset updated incrementally.
    pub fn strided(&self, shape: Vec<usize>, strides: &[usize]) -> HostTensor {
        let n: usize = shape.iter().product();
        let rank = shape.len();
        let data = map_same!(&self.data, v => {
            let mut out = Vec::with_capacity(n);
            let mut counter = vec![0usize; rank];
            let mut pos = 0usize;
            let inner = if rank > 0 { shape[rank - 1] } else { 1 };
            let inner_stride = if rank > 0 { strides[rank - 1] } else { 0 };
            let mut done = 0;
            while done < n {
                // The innermost dim as a tight loop.
                if inner_stride == 1 {
                    out.extend_from_slice(&v[pos..pos + inner]);
                } else {
                    out.extend((0..inner).map(|i| v[pos + i * inner_stride]));
                }
                done += inner;
                for d in (0..rank.saturating_sub(1)).rev() {
                    counter[d] += 1;
                    pos += strides[d];
                    if counter[d] < shape[d] {
                        break;
                    }
                    pos -= strides[d] * counter[d];
                    counter[d] = 0;
                }
                if rank == 0 {
                    break;
                }
            }
            out
        });
        HostTensor { shape, data }
    }

    pub fn with_shape(mut self, shape: Vec<usize>) -> HostTensor {
        self.shape = shape;
        self
    }
}

/// Applies `$e` (which builds a `Vec` of the same element type from `$v`) to every variant.
macro_rules! map_same {
    ($data:expr, $v:ident => $e:expr) => {
        match $data {
            Data::F32($v) => Data::F32({
                let v: Vec<_> = $e;
                v.into()
            }),
            Data::F16($v) => Data::F16({
                let v: Vec<_> = $e;
                v.into()
            }),
            Data::BF16($v) => Data::BF16({
                let v: Vec<_> = $e;
                v.into()
            }),
            Data::F64($v) => Data::F64({
                let v: Vec<_> = $e;
                v.into()
            }),
            Data::I64($v) => Data::I64({
                let v: Vec<_> = $e;
                v.into()
            }),
            Data::I32($v) => Data::I32({
                let v: Vec<_> = $e;
                v.into()
            }),
            Data::I16($v) => Data::I16({
                let v: Vec<_> = $e;
                v.into()
            }),
            Data::I8($v) => Data::I8({
                let v: Vec<_> = $e;
                v.into()
            }),
            Data::U64($v) => Data::U64({
                let v: Vec<_> = $e;
                v.into()
            }),
            Data::U32($v) => Data::U32({
                let v: Vec<_> = $e;
                v.into()
            }),
            Data::U16($v) => Data::U16({
                let v: Vec<_> = $e;
                v.into()
            }),
            Data::U8($v) => Data::U8({
                let v: Vec<_> = $e;
                v.into()
            }),
            Data::Bool($v) => Data::Bool({
                let v: Vec<_> = $e;
                v.into()
            }),
        }
    };
}
pub(crate) use map_same;

/// Concatenates runs `(part, start, len)` of same-dtype tensors, in order. Every part must have
/// the first part's dtype (type inference guarantees it for the ops that call this).
pub fn gather_runs(parts: &[&HostTensor], shape: Vec<usize>, runs: &[(usize, usize, usize)]) -> HostTensor {
    macro_rules! cat {
        ($($var:ident),*) => {
            match &parts[0].data {
                $(Data::$var(_) => {
                    let mut out = Vec::with_capacity(runs.iter().map(|r| r.2).sum());
                    for &(p, s, n) in runs {
                        match &parts[p].data {
                            Data::$var(v) => out.extend_from_slice(&v[s..s + n]),
                            other => panic!("gather_runs: parts of different dtypes ({:?} and {:?})", parts[0].dtype(), HostTensor { shape: vec![], data: other.clone() }.dtype()),
                        }
                    }
                    Data::$var(out.into())
                })*
            }
        };
    }
    HostTensor { shape, data: cat!(F32, F16, BF16, F64, I64, I32, I16, I8, U64, U32, U16, U8, Bool) }
}

impl HostTensor {
    /// A tensor of `dtype` and `shape` from its little-endian bytes (`bytes` holds exactly them).
    pub fn from_le_bytes(dtype: DType, shape: Vec<usize>, b: &[u8]) -> HostTensor {
        /// The elements as a Vec, by one copy of the bytes on little-endian machines.
        fn copied<T: Copy + Pod>(b: &[u8], decode: impl Fn(&[u8]) -> T) -> Vec<T> {
            let n = b.len() / std::mem::size_of::<T>();
            if cfg!(target_endian = "little") {
                let mut v: Vec<T> = Vec::with_capacity(n);
                // SAFETY: `T` is a plain number type (`Pod`: every bit pattern is a value, no
                // padding), the Vec has room for `n` elements, and on a little-endian machine its
                // in-memory bytes are the file's. `b` and the Vec do not overlap.
                unsafe {
                    std::ptr::copy_nonoverlapping(b.as_ptr(), v.as_mut_ptr() as *mut u8, n * std::mem::size_of::<T>());
                    v.set_len(n);
                }
                v
            } else {
                b.chunks_exact(std::mem::size_of::<T>()).map(decode).collect()
            }
        }
        macro_rules! le {
            ($ty:ty) => {
                copied::<$ty>(b, |c| <$ty>::from_le_bytes(c.try_into().expect("chunk size")))
            };
        }
        let data = match dtype {
            DType::F32 => Data::F32(le!(f32).into()),
            DType::F16 => Data::F16(le!(f16).into()),
            DType::BF16 => Data::BF16(le!(bf16).into()),
            DType::F64 => Data::F64(le!(f64).into()),
            DType::I64 => Data::I64(le!(i64).into()),
            DType::I32 => Data::I32(le!(i32).into()),
            DType::I16 => Data::I16(le!(i16).into()),
            DType::I8 => Data::I8(b.iter().map(|&x| x as i8).collect()),
            DType::U64 => Data::U64(le!(u64).into()),
            DType::U32 => Data::U32(le!(u32).into()),
            DType::U16 => Data::U16(le!(u16).into()),
            DType::U8 => Data::U8(b.to_vec().into()),
            DType::Bool => Data::Bool(b.iter().map(|&x| x != 0).collect()),
        };
        HostTensor { shape, data }
    }

    /// Writes the elements' little-endian bytes into `out`, which holds exactly [`HostTensor::bytes`].
    pub fn write_le_bytes(&self, out: &mut [u8]) {
        fn put<T: Copy + Pod>(v: &[T], out: &mut [u8], encode: impl Fn(&T, &mut [u8])) {
            let size = std::mem::size_of::<T>();
            assert_eq!(out.len(), std::mem::size_of_val(v), "write_le_bytes: the output holds another size");
            if cfg!(target_endian = "little") {
                // SAFETY: `T` is a plain number type whose in-memory bytes, on a little-endian
                // machine, are its little-endian encoding; the lengths were checked above.
                unsafe { std::ptr::copy_nonoverlapping(v.as_ptr() as *const u8, out.as_mut_ptr(), out.len()) }
            } else {
                out.chunks_exact_mut(size).zip(v).for_each(|(c, x)| encode(x, c));
            }
        }
        macro_rules! put {
            ($v:expr) => {
                put($v, out, |x, c| c.copy_from_slice(&x.to_le_bytes()))
            };
        }
        match &self.data {
            Data::F32(v) => put!(v),
            Data::F16(v) => put!(v),
            Data::BF16(v) => put!(v),
            Data::F64(v) => put!(v),
            Data::I64(v) => put!(v),
            Data::I32(v) => put!(v),
            Data::I16(v) => put!(v),
            Data::I8(v) => out.iter_mut().zip(v).for_each(|(o, &x)| *o = x as u8),
            Data::U64(v) => put!(v),
            Data::U32(v) => put!(v),
            Data::U16(v) => put!(v),
            Data::U8(v) => out.copy_from_slice(v),
            Data::Bool(v) => out.iter_mut().zip(v).for_each(|(o, &x)| *o = x as u8),
        }
    }
}

/// Number types whose every bit pattern is a value and that have no padding: their bytes can be
/// copied in and out as a block.
trait Pod {}
impl Pod for f32 {}
impl Pod for f64 {}
impl Pod for f16 {}
impl Pod for bf16 {}
impl Pod for i64 {}
impl Pod for i32 {}
impl Pod for i16 {}
impl Pod for u64 {}
impl Pod for u32 {}
impl Pod for u16 {}

impl From<&Tensor> for HostTensor {
    fn from(t: &Tensor) -> HostTensor {
        let shape: Vec<usize> = t.shape().iter().map(|&d| d as usize).collect();
        HostTensor::from_le_bytes(t.dtype(), shape, t.bytes())
    }
}

impl From<&HostTensor> for Tensor {
    fn from(h: &HostTensor) -> Tensor {
        let mut out = vec![0u8; h.bytes()];
        h.write_le_bytes(&mut out);
        let shape = h.shape.iter().map(|&d| d as u64).collect();
        Tensor::from_bytes(h.dtype(), shape, out.into()).expect("host tensor bytes match its shape")
    }
}

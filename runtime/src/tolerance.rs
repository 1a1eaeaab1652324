//! [`Tolerance`]: how close a computed tensor must be to a reference, with presets per dtype. One
//! type serves every numeric comparison: a device against the CPU reference, mixed precision
//! against FP32, a run against the expected outputs of a conformance case.

use mpc_ir::DType;

use crate::value::HostTensor;

/// Bounds on the difference between `got` and `want`: every element within `atol + rtol·|want|`,
/// and the relative L2 error `‖got − want‖ / ‖want‖` at most `rel_l2`. NaN matches NaN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub rtol: f64,
    pub atol: f64,
    pub rel_l2: f64,
}

/// What a comparison measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    pub max_abs: f64,
    pub rel_l2: f64,
    /// Elements outside `atol + rtol·|want|`, and the first of them.
    pub outliers: usize,
    pub first_bad: Option<usize>,
}

impl Tolerance {
    /// Bit for bit (NaN matches NaN).
    pub const EXACT: Tolerance = Tolerance { rtol: 0.0, atol: 0.0, rel_l2: 0.0 };
    /// The ONNX backend tests' bounds (rtol 1e-3, atol 1e-5 per element).
    pub const ONNX: Tolerance = Tolerance { rtol: 1e-3, atol: 1e-5, rel_l2: f64::INFINITY };

    /// What two correct implementations may differ by in `dtype` (another summation order,
    /// fused multiply-adds): a few units in the last place, more for the 16-bit formats.
    pub fn for_dtype(dtype: DType) -> Tolerance {
        match dtype {
            DType::F64 => Tolerance { rtol: 1e-12, atol: 1e-14, rel_l2: 1e-12 },
            DType::F32 => Tolerance { rtol: 1e-5, atol: 1e-6, rel_l2: 1e-5 },
            DType::F16 => Tolerance { rtol: 2e-3, atol: 1e-4, rel_l2: 1e-3 },
            DType::BF16 => Tolerance { rtol: 1.6e-2, atol: 1e-3, rel_l2: 8e-3 },
            _ => Tolerance::EXACT,
        }
    }

    /// Compares `got` with `want`: an error message naming the first element out of bounds, or
    /// what was measured. Dtypes and shapes must be equal.
    pub fn check(&self, got: &HostTensor, want: &HostTensor) -> Result<Comparison, String> {
        if got.dtype() != want.dtype() {
            return Err(format!("dtype {}, expected {}", got.dtype(), want.dtype()));
        }
        if got.shape != want.shape {
            return Err(format!("shape {:?}, expected {:?}", got.shape, want.shape));
        }
        let c = self.measure(got, want);
        match c.first_bad {
            Some(i) if !got.dtype().is_float() && !want.dtype().is_float() => Err(format!(
                "element {i}: {} where {} was expected ({} of {} elements differ)",
                got.i64s().map_or(0, |v| v[i]),
                want.i64s().map_or(0, |v| v[i]),
                c.outliers,
                want.len(),
            )),
            Some(i) => Err(format!(
                "element {i}: {} where {} was expected ({} of {} elements out of rtol {} / atol {}; max abs error {:.3e})",
                got.f64s()[i],
                want.f64s()[i],
                c.outliers,
                want.len(),
                self.rtol,
                self.atol,
                c.max_abs
            )),
            None if c.rel_l2 > self.rel_l2 => {
                Err(format!("relative L2 error {:.3e} above {:.1e}", c.rel_l2, self.rel_l2))
            }
            None => Ok(c),
        }
    }

    /// The differences, without judging them.
    pub fn measure(&self, got: &HostTensor, want: &HostTensor) -> Comparison {
        let (g, w) = (got.f64s(), want.f64s());
        // Integers compare as integers: f64 cannot tell 64-bit values past 2^53 apart.
        let ints = match (got.dtype().is_float() || want.dtype().is_float(), got.i64s(), want.i64s()) {
            (false, Some(a), Some(b)) => Some((a, b)),
            _ => None,
        };
        let (mut max_abs, mut diff2, mut want2, mut outliers, mut first_bad) = (0f64, 0f64, 0f64, 0usize, None);
        for (i, (&a, &e)) in g.iter().zip(&w).enumerate() {
            let same = match &ints {
                Some((x, y)) => x[i] == y[i],
                None => a == e || (a.is_nan() && e.is_nan()) || a.to_bits() == e.to_bits(),
            };
            // Two integers that differ differ by 1 at least, whatever f64 made of them.
            let d = match (same, &ints) {
                (true, _) => 0.0,
                (false, Some(_)) => (a - e).abs().max(1.0),
                (false, None) => (a - e).abs(),
            };
            // A NaN difference (a number for a NaN) is out of bounds too.
            let within = d <= self.atol + self.rtol * e.abs();
            let bad = !same && !within;
            if bad {
                outliers += 1;
                first_bad.get_or_insert(i);
            }
            if d.is_finite() {
                max_abs = max_abs.max(d);
                diff2 += d * d;
            } else if !same {
                max_abs = f64::INFINITY;
                diff2 = f64::INFINITY;
            }
            if e.is_finite() {
                want2 += e * e;
            }
        }
        let rel_l2 = if diff2 == 0.0 { 0.0 } else { (diff2 / want2.max(f64::MIN_POSITIVE)).sqrt() };
        Comparison { max_abs, rel_l2, outliers, first_bad }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f64]) -> HostTensor {
        HostTensor::from_f64(DType::F32, vec![v.len()], v.to_vec())
    }

    #[test]
    fn bounds_and_reports() {
        let want = t(&[1.0, 2.0, f64::NAN, 4.0]);
        assert!(Tolerance::EXACT.check(&want, &want).is_ok(), "NaN matches NaN");
        let got = t(&[1.0, 2.0001, f64::NAN, 4.0]);
        assert!(Tolerance::ONNX.check(&got, &want).is_ok());
        let e = Tolerance::EXACT.check(&got, &want).unwrap_err();
        assert!(e.starts_with("element 1:"), "{e}");
        // 64-bit integers past 2^53 that f64 rounds to one value still differ.
        let big = |v: i64| HostTensor::from_i64(DType::I64, vec![1], vec![v]);
        let e = Tolerance::EXACT.check(&big(i64::MAX - 1), &big(i64::MAX)).unwrap_err();
        assert!(e.contains("9223372036854775806 where 9223372036854775807"), "{e}");
        let far = t(&[1.0, 3.0, f64::NAN, 4.0]);
        assert!(Tolerance::for_dtype(DType::F32).check(&far, &want).unwrap_err().contains("element 1"));
        let c = Tolerance::ONNX.measure(&far, &want);
        assert_eq!((c.max_abs, c.outliers), (1.0, 1));
        assert!(Tolerance::ONNX.check(&t(&[1.0]), &want).unwrap_err().contains("shape"));
        let lose = t(&[1.0, 2.0, 0.0, 4.0]);
        assert!(Tolerance::ONNX.check(&lose, &want).is_err(), "a number for a NaN");
    }
}

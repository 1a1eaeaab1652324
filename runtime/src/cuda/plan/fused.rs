//! The plan of a fused chain ([`crate::fuse`]): one kernel generated for the chain, compiled by
//! NVRTC when the program is prepared (and cached like the kernel families).
//!
//! The kernel walks the output's elements once: it loads each input at the element's offset (a
//! broadcast input through its strides, the dims and strides written into the source as
//! constants), computes each step with the functor that step's own kernel uses (`U_<op>` and
//! `V_<op>` of common.cuh), rounds the result to the step's dtype, and stores the chain's
//! outputs. An f32 step's result passes through `mpc_keep`, an empty asm the compiler cannot see
//! through, so a product is never contracted with the next step's sum into one FMA: the unfused
//! kernels round every result through memory, and a chain keeps those roundings.

use std::fmt::Write;
use std::sync::Arc;

use super::elementwise::{binary_name, unary_name};
use super::*;
use crate::fuse::{Chain, ChainArg};

/// What a fused chain's kernel computes, and its source.
#[derive(Clone, Debug, PartialEq)]
pub struct Fused {
    pub chain: Chain,
    /// Each input's dtype in memory and element strides over `dims` (0 where it is broadcast).
    pub inputs: Vec<(DType, Vec<i64>)>,
    /// Which inputs the chain reads widened to f32 ([`crate::program::Operand::Widened`]).
    pub widened: Vec<bool>,
    /// Each output's dtype (every output is contiguous over `dims`).
    pub outputs: Vec<DType>,
    /// The output's dims, coalesced (row-major): how an element's index gives each input's offset.
    pub dims: Vec<i64>,
    /// The output's shape (a softmax step works along one of its axes).
    pub shape: Vec<usize>,
    /// Elements each thread takes at a time (1, 4 or 8; an element-wise chain): the contiguous
    /// inputs and the outputs loaded and stored that many at once ([`vector_width`]).
    pub vector: usize,
    /// The kernel's source (`common.cuh` is put before it when it is compiled).
    pub source: String,
}

fn ctype(d: DType) -> Result<&'static str, String> {
    Ok(match d {
        DType::F32 => "float",
        DType::F16 => "__half",
        DType::BF16 => "__nv_bfloat16",
        d => return Err(format!("a fused chain over {d}")),
    })
}

/// A float as an exact literal: its bits.
fn float_lit(v: f32) -> String {
    format!("__int_as_float({})", v.to_bits() as i32)
}

pub(super) fn plan_chain(p: &mut Planner, chain: &Chain) -> Result<(), String> {
    let outs: Vec<&TensorRef> = p.l.outputs.iter().collect();
    let full = outs.first().ok_or("a fused launch without outputs")?.shape.clone();
    if outs.iter().any(|o| o.shape != full) || outs.len() != chain.outputs.len() {
        return Err("a fused launch whose outputs differ in shape".into());
    }
    // An input read widened is loaded from its f16/bf16 place: `ld` widens what it loads.
    let (ins, widened): (Vec<&TensorRef>, Vec<bool>) =
        (0..p.l.inputs.len()).map(|i| p.input_or_widened(i)).collect::<Result<Vec<_>, _>>()?.into_iter().unzip();
    let apart = |t: &&&TensorRef| mpc_ir::geometry::broadcast_shape(&[&t.shape, &full]).is_none_or(|b| b != full);
    if let Some(t) = ins.iter().find(apart) {
        return Err(format!("a fused input of shape {:?} does not broadcast to {full:?}", t.shape));
    }
    let mut strides: Vec<Vec<i64>> = ins.iter().map(|t| us(&broadcast_strides(&t.shape, &full))).collect();
    strides.push(contiguous(&full));
    let refs: Vec<&[i64]> = strides.iter().map(Vec::as_slice).collect();
    let (dims, mut walks) = coalesce(&full, &refs);
    walks.pop();
    let n = numel(&full);
    let inputs: Vec<(DType, Vec<i64>)> = ins.iter().map(|t| t.dtype).zip(walks).collect();
    let outputs: Vec<DType> = outs.iter().map(|t| t.dtype).collect();
    let mut g = Gen { chain, inputs: &inputs, dims: &dims, wide: n > u32::MAX as u64, vector: 1 };
    let (body, grid, block) = match chain.row_step() {
        None => {
            let wide: Vec<&TensorRef> =
                ins.iter().copied().filter(|t| read_whole(t, n)).chain(outs.iter().copied()).collect();
            g.vector = vector_width(n, &wide, p.opts.wide);
            (g.elementwise(&outputs)?, grid_for(n / g.vector as u64), [BLOCK, 1, 1])
        }
        Some(r) => {
            let axis = match &chain.steps[r].op {
                Op::Softmax(a) | Op::LogSoftmax(a) => a.axis,
                Op::SoftmaxGrad(a) => a.axis,
                _ => unreachable!("a row-wise step"),
            };
            let ax = normalize_axis(axis, full.len()).ok_or("softmax axis out of range")?;
            let (outer, len, inner) = split3(&full, ax, ax + 1);
            // The unfused softmax's launch: the same block, so the same reduction order.
            let block = row_block(len);
            let body = if matches!(chain.steps[r].op, Op::SoftmaxGrad(_)) {
                g.grad_rows(&outputs, r, (outer, len, inner))?
            } else {
                g.rows(&outputs, r, (outer, len, inner))?
            };
            (body, rows_grid(outer * inner), [block, 1, 1])
        }
    };
    let name = format!("fused_{:016x}", fnv(body.as_bytes()));
    let source = format!("MPC_KERNEL {name}{body}");
    let mut args: Vec<Arg> = ins.iter().map(|t| Arg::Ptr(buf(t))).collect();
    args.extend(outs.iter().map(|t| Arg::Ptr(buf(t))));
    args.push(Arg::I64(n as i64));
    let vector = g.vector;
    let fused = Fused { chain: chain.clone(), inputs, widened, outputs, dims, shape: full, source, vector };
    p.out.calls.push(Call::Kernel(Kernel { family: "fused", name, grid, block, args, fused: Some(Arc::new(fused)) }));
    Ok(())
}

/// Whether an input of an element-wise launch, which broadcasts to the output's shape, is read
/// whole: every element once, in the output's order. That is when it has as many elements as the
/// output (only dims of 1 can then tell the shapes apart), so its coalesced walk is the output's.
pub(super) fn read_whole(t: &TensorRef, n: u64) -> bool {
    t.numel() as u64 == n
}

/// The elements an element-wise chain's threads take at a time: 8 where every tensor it reads
/// or writes whole (`wide`: the outputs and the inputs that are not broadcast) is of 2 bytes, else
/// 4, where the count is a multiple and each such tensor starts on a multiple of that many
/// elements' bytes (each access then one 8- or 16-byte load or store); else 1.
pub fn vector_width(n: u64, wide: &[&TensorRef], on: bool) -> usize {
    if !on {
        return 1;
    }
    let widest = wide.iter().map(|t| t.dtype.size()).max().unwrap_or(4);
    [8usize, 4]
        .into_iter()
        .filter(|&v| v == 4 || widest == 2)
        .find(|&v| n % v as u64 == 0 && wide.iter().all(|t| t.offset % (v * t.dtype.size()) as u64 == 0))
        .unwrap_or(1)
}

/// FNV-1a: the kernel's name from its source, the same across runs and machines.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

/// What the generated code needs of a chain.
struct Gen<'a> {
    chain: &'a Chain,
    inputs: &'a [(DType, Vec<i64>)],
    dims: &'a [i64],
    /// Element indices past 32 bits.
    wide: bool,
    /// Elements a thread takes at a time ([`vector_width`]).
    vector: usize,
}

impl Gen<'_> {
    /// The parameters: inputs, outputs, the element count.
    fn params(&self, outputs: &[DType]) -> Result<String, String> {
        let mut params: Vec<String> = Vec::new();
        for (k, (d, _)) in self.inputs.iter().enumerate() {
            params.push(format!("const {}* in{k}", ctype(*d)?));
        }
        for (j, d) in outputs.iter().enumerate() {
            params.push(format!("{}* out{j}", ctype(*d)?));
        }
        params.push("long long n".into());
        Ok(params.join(", "))
    }

    fn contiguous(&self) -> Vec<i64> {
        let mut c = vec![0i64; self.dims.len()];
        let mut acc = 1i64;
        for d in (0..self.dims.len()).rev() {
            c[d] = acc;
            acc *= self.dims[d];
        }
        c
    }

    /// The inputs loaded at element `e` (`a<k>`), then steps `from..to` (`s<j>`), at `pad`.
    fn element(&self, e: &str, steps: std::ops::Range<usize>, pad: &str) -> Result<String, String> {
        self.element_from(e, steps, pad, None)
    }

    /// [`Gen::element`], the contiguous inputs taken from `v<k>[unit]` (loaded `vector` at a time)
    /// where `unit` is given.
    fn element_from(
        &self,
        e: &str,
        steps: std::ops::Range<usize>,
        pad: &str,
        unit: Option<&str>,
    ) -> Result<String, String> {
        let mut s = String::new();
        let contiguous = self.contiguous();
        let walks = |st: &[i64]| st != contiguous.as_slice();
        // The coordinates some broadcast input steps along, from the innermost to the outermost.
        let needed: Vec<bool> =
            (0..self.dims.len()).map(|d| self.inputs.iter().any(|(_, st)| walks(st) && st[d] != 0)).collect();
        if let Some(outer) = needed.iter().position(|&x| x) {
            let ity = if self.wide { "unsigned long long" } else { "unsigned int" };
            let _ = writeln!(s, "{pad}{ity} r = ({ity}){e};");
            for d in (outer..self.dims.len()).rev() {
                if needed[d] {
                    let c = if d == 0 { "r".to_string() } else { format!("r % {}u", self.dims[d]) };
                    let _ = writeln!(s, "{pad}const {ity} c{d} = {c};");
                }
                if d > outer {
                    let _ = writeln!(s, "{pad}r /= {}u;", self.dims[d]);
                }
            }
        }
        for (k, (_, st)) in self.inputs.iter().enumerate() {
            if let (Some(u), false) = (unit, walks(st)) {
                let _ = writeln!(s, "{pad}const float a{k} = v{k}[{u}];");
                continue;
            }
            let at = if !walks(st) {
                e.to_string()
            } else {
                let terms: Vec<String> = st
                    .iter()
                    .enumerate()
                    .filter(|(_, &x)| x != 0)
                    .map(|(d, x)| format!("(long long)c{d} * {x}LL"))
                    .collect();
                if terms.is_empty() {
                    "0".to_string()
                } else {
                    terms.join(" + ")
                }
            };
            let _ = writeln!(s, "{pad}const float a{k} = ld(in{k}, {at});");
        }
        for j in steps {
            let step = &self.chain.steps[j];
            let expr = self.expr(j)?;
            let _ = writeln!(s, "{pad}const float s{j} = mpc_keep(round_to<{}>({expr}));", ctype(step.dtype)?);
        }
        Ok(s)
    }

    fn arg(&self, j: usize, a: &ChainArg) -> Result<String, String> {
        match *a {
            ChainArg::Input(k) if k < self.inputs.len() => Ok(format!("a{k}")),
            ChainArg::Step(k) if k < j => Ok(format!("s{k}")),
            _ => Err(format!("{}: an argument past the chain", self.chain.steps[j].node)),
        }
    }

    /// Step `j`'s element-wise value, from its arguments.
    fn expr(&self, j: usize) -> Result<String, String> {
        let step = &self.chain.steps[j];
        let args = step.args.iter().map(|a| self.arg(j, a)).collect::<Result<Vec<_>, _>>()?;
        Ok(match (&step.op, args.as_slice()) {
            (Op::Cast(_), [x]) => x.clone(),
            (op, [x]) => {
                let (_, name, [alpha, beta]) = unary_name(op).ok_or_else(|| format!("{}: not fusable", step.node))?;
                format!("U_{name}()({x}, {}, {})", float_lit(alpha), float_lit(beta))
            }
            (op, [a, b]) => {
                let name = binary_name(op).ok_or_else(|| format!("{}: not fusable", step.node))?;
                format!("V_{name}()({a}, {b})")
            }
            _ => return Err(format!("{}: {} arguments in a fused step", step.node, args.len())),
        })
    }

    fn stores(&self, e: &str, pad: &str) -> Result<String, String> {
        let mut s = String::new();
        for (j, &k) in self.chain.outputs.iter().enumerate() {
            if k >= self.chain.steps.len() {
                return Err("an output past the chain".into());
            }
            let _ = writeln!(s, "{pad}st(out{j}, {e}, s{k});");
        }
        Ok(s)
    }

    /// An element-wise chain: one pass over the elements, `vector` at a time where more than one:
    /// the contiguous inputs loaded and the outputs stored that many at once, each element's
    /// steps as in the scalar kernel (the same bits).
    fn elementwise(&self, outputs: &[DType]) -> Result<String, String> {
        let mut s = String::new();
        let _ = writeln!(s, "({}) {{", self.params(outputs)?);
        let v = self.vector;
        if v > 1 {
            let contiguous = self.contiguous();
            let loaded: Vec<usize> = (0..self.inputs.len()).filter(|&k| self.inputs[k].1 == contiguous).collect();
            let _ = writeln!(s, "    MPC_GRID_STRIDE(q, n / {v}) {{");
            let _ = writeln!(s, "        const long long i = q * {v};");
            for &k in &loaded {
                let _ = writeln!(s, "        float v{k}[{v}];\n        ldv<{v}>(in{k}, i, v{k});");
            }
            for j in 0..outputs.len() {
                let _ = writeln!(s, "        float w{j}[{v}];");
            }
            let _ = writeln!(s, "#pragma unroll");
            let _ = writeln!(s, "        for (int u = 0; u < {v}; ++u) {{");
            let pad = "            ";
            if loaded.len() < self.inputs.len() {
                let _ = writeln!(s, "{pad}const long long e = i + u;\n{pad}(void)e;");
            }
            s.push_str(&self.element_from("e", 0..self.chain.steps.len(), pad, Some("u"))?);
            for (j, &k) in self.chain.outputs.iter().enumerate() {
                if k >= self.chain.steps.len() {
                    return Err("an output past the chain".into());
                }
                let _ = writeln!(s, "{pad}w{j}[u] = s{k};");
            }
            let _ = writeln!(s, "        }}");
            for j in 0..outputs.len() {
                let _ = writeln!(s, "        stv<{v}>(out{j}, i, w{j});");
            }
            let _ = writeln!(s, "    }}");
            let _ = writeln!(s, "}}");
            return Ok(s);
        }
        let _ = writeln!(s, "    MPC_GRID_STRIDE(i, n) {{");
        s.push_str(&self.element("i", 0..self.chain.steps.len(), "        ")?);
        s.push_str(&self.stores("i", "        ")?);
        let _ = writeln!(s, "    }}");
        let _ = writeln!(s, "}}");
        Ok(s)
    }

    /// A chain around a SoftmaxGrad (step `r`, reading dy and y): softmax.cu's two passes over
    /// each row (the sum of dy·y, then dx = y·(dy − sum)).
    fn grad_rows(&self, outputs: &[DType], r: usize, rows: (u64, u64, u64)) -> Result<String, String> {
        let row = &self.chain.steps[r];
        let (dy, y) = match row.args.as_slice() {
            [a, b] => (self.arg(r, a)?, self.arg(r, b)?),
            _ => return Err(format!("{}: a SoftmaxGrad of {} inputs", row.node, row.args.len())),
        };
        let last = self.row_result(r, &format!("{y} * ({dy} - sum)"))?;
        let passes = [
            (format!("sum += {dy} * {y};"), "sum = block_reduce(sum, OpSum(), smem);".to_string()),
            (last, String::new()),
        ];
        self.row_kernel(outputs, r, rows, "float sum = 0.0f;", &passes)
    }

    /// A chain around a softmax (step `r`): softmax.cu's three passes over each row (the max,
    /// the sum of the exponentials, then the result).
    fn rows(&self, outputs: &[DType], r: usize, rows: (u64, u64, u64)) -> Result<String, String> {
        let row = &self.chain.steps[r];
        let x = match row.args.as_slice() {
            [a] => self.arg(r, a)?,
            _ => return Err(format!("{}: a softmax of {} inputs", row.node, row.args.len())),
        };
        let value = if matches!(row.op, Op::LogSoftmax(_)) {
            format!("({x} - m) - ls")
        } else {
            format!("m_exp({x} - m) / sum")
        };
        let passes = [
            (format!("m = m_fmax(m, {x});"), "m = block_reduce(m, OpFmaxF(), smem);\n        float sum = 0.0f;".into()),
            (
                format!("sum += m_exp({x} - m);"),
                "sum = block_reduce(sum, OpSum(), smem);\n        const float ls = m_log(sum);\n        (void)ls;"
                    .into(),
            ),
            (self.row_result(r, &value)?, String::new()),
        ];
        self.row_kernel(outputs, r, rows, "float m = -m_inf(0.0f);", &passes)
    }

    /// The last pass's statements: the row-wise step's result, the steps after it, the stores.
    fn row_result(&self, r: usize, value: &str) -> Result<String, String> {
        let pad = "            ";
        let mut s = format!("const float s{r} = mpc_keep(round_to<{}>({value}));\n", ctype(self.chain.steps[r].dtype)?);
        for j in r + 1..self.chain.steps.len() {
            let expr = self.expr(j)?;
            let _ = writeln!(
                s,
                "{pad}const float s{j} = mpc_keep(round_to<{}>({expr}));",
                ctype(self.chain.steps[j].dtype)?
            );
        }
        s.push_str(&self.stores("e", pad)?);
        Ok(s)
    }

    /// One block per row of `len` elements `inner` apart, `outer * inner` rows (softmax.cu's
    /// launch): `start`, then each pass over the row's elements, which computes the steps before
    /// the row-wise step `r` as it reads and then its statements, followed by its reduction.
    fn row_kernel(
        &self,
        outputs: &[DType],
        r: usize,
        (outer, len, inner): (u64, u64, u64),
        start: &str,
        passes: &[(String, String)],
    ) -> Result<String, String> {
        let pad = "            ";
        let mut s = String::new();
        let _ = writeln!(s, "({}) {{", self.params(outputs)?);
        let _ = writeln!(s, "    (void)n;");
        let _ = writeln!(s, "    __shared__ float smem[32];");
        let _ = writeln!(s, "    for (long long row = blockIdx.x; row < {}LL; row += gridDim.x) {{", outer * inner);
        let _ = writeln!(s, "        const long long base = (row / {inner}LL) * {}LL + row % {inner}LL;", len * inner);
        let _ = writeln!(s, "        {start}");
        for (body, after) in passes {
            let _ = writeln!(s, "        for (long long k = threadIdx.x; k < {len}LL; k += blockDim.x) {{");
            let _ = writeln!(s, "{pad}const long long e = base + k * {inner}LL;");
            s.push_str(&self.element("e", 0..r, pad)?);
            let _ = writeln!(s, "{pad}{}", body.trim_end());
            let _ = writeln!(s, "        }}");
            if !after.is_empty() {
                let _ = writeln!(s, "        {after}");
            }
        }
        let _ = writeln!(s, "    }}");
        let _ = writeln!(s, "}}");
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::vector_width;
    use crate::program::{Region, TensorRef};
    use mpc_ir::DType;

    fn t(offset: u64, dtype: DType) -> TensorRef {
        TensorRef { region: Region::Arena, offset, dtype, shape: vec![64] }
    }

    /// 16-byte accesses where every whole tensor is of 2 bytes, 8 or 16 bytes (4 elements) where
    /// one is of 4, and one element at a time where a count or a start does not fit.
    #[test]
    fn chains_take_as_many_elements_at_a_time_as_their_tensors_allow() {
        let (h, f) = (DType::F16, DType::F32);
        assert_eq!(vector_width(1024, &[&t(0, h), &t(4096, h)], true), 8);
        assert_eq!(vector_width(1024, &[&t(0, h), &t(4096, h)], false), 1, "wide accesses off");
        assert_eq!(vector_width(1024, &[&t(0, h), &t(4096, f)], true), 4);
        assert_eq!(vector_width(1024, &[&t(8, h), &t(4096, h)], true), 4, "8-byte aligned only");
        assert_eq!(vector_width(1020, &[&t(0, h)], true), 4);
        assert_eq!(vector_width(1022, &[&t(0, h)], true), 1);
        assert_eq!(vector_width(1024, &[&t(0, f), &t(8, f)], true), 1, "an f32 tensor off a 16-byte boundary");
    }
}

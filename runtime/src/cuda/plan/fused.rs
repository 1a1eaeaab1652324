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
    /// Each input's dtype and element strides over `dims` (0 where it is broadcast).
    pub inputs: Vec<(DType, Vec<i64>)>,
    /// Each output's dtype (every output is contiguous over `dims`).
    pub outputs: Vec<DType>,
    /// The output's dims, coalesced (row-major).
    pub dims: Vec<i64>,
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
    let ins: Vec<&TensorRef> = (0..p.l.inputs.len()).map(|i| p.input(i)).collect::<Result<_, _>>()?;
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
    let body = generate(chain, &inputs, &outputs, &dims, n)?;
    let name = format!("fused_{:016x}", fnv(body.as_bytes()));
    let source = format!("MPC_KERNEL {name}{body}");
    let mut args: Vec<Arg> = ins.iter().map(|t| Arg::Ptr(buf(t))).collect();
    args.extend(outs.iter().map(|t| Arg::Ptr(buf(t))));
    args.push(Arg::I64(n as i64));
    let fused = Fused { chain: chain.clone(), inputs, outputs, dims, source };
    p.out.calls.push(Call::Kernel(Kernel {
        family: "fused",
        name,
        grid: grid_for(n),
        block: [BLOCK, 1, 1],
        args,
        fused: Some(Arc::new(fused)),
    }));
    Ok(())
}

/// FNV-1a: the kernel's name from its source, the same across runs and machines.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

/// The kernel after its name: parameters and body.
fn generate(
    chain: &Chain,
    inputs: &[(DType, Vec<i64>)],
    outputs: &[DType],
    dims: &[i64],
    n: u64,
) -> Result<String, String> {
    let mut s = String::new();
    let mut params: Vec<String> = Vec::new();
    for (k, (d, _)) in inputs.iter().enumerate() {
        params.push(format!("const {}* in{k}", ctype(*d)?));
    }
    for (j, d) in outputs.iter().enumerate() {
        params.push(format!("{}* out{j}", ctype(*d)?));
    }
    params.push("long long n".into());
    let _ = writeln!(s, "({}) {{", params.join(", "));
    let _ = writeln!(s, "    MPC_GRID_STRIDE(i, n) {{");
    // Row-major coordinates of element i, where an input needs them (32-bit when n fits).
    let contiguous = {
        let mut c = vec![0i64; dims.len()];
        let mut acc = 1i64;
        for d in (0..dims.len()).rev() {
            c[d] = acc;
            acc *= dims[d];
        }
        c
    };
    let walks = |st: &[i64]| st != contiguous.as_slice();
    // The coordinates some broadcast input steps along, from the innermost to the outermost.
    let needed: Vec<bool> = (0..dims.len()).map(|d| inputs.iter().any(|(_, st)| walks(st) && st[d] != 0)).collect();
    if let Some(outer) = needed.iter().position(|&x| x) {
        let ity = if n > u32::MAX as u64 { "unsigned long long" } else { "unsigned int" };
        let _ = writeln!(s, "        {ity} r = ({ity})i;");
        for d in (outer..dims.len()).rev() {
            if needed[d] {
                let c = if d == 0 { "r".to_string() } else { format!("r % {}u", dims[d]) };
                let _ = writeln!(s, "        const {ity} c{d} = {c};");
            }
            if d > outer {
                let _ = writeln!(s, "        r /= {}u;", dims[d]);
            }
        }
    }
    for (k, (_, st)) in inputs.iter().enumerate() {
        let at = if !walks(st) {
            "i".to_string()
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
        let _ = writeln!(s, "        const float a{k} = ld(in{k}, {at});");
    }
    for (j, step) in chain.steps.iter().enumerate() {
        let arg = |a: &ChainArg| match *a {
            ChainArg::Input(k) if k < inputs.len() => Ok(format!("a{k}")),
            ChainArg::Step(k) if k < j => Ok(format!("s{k}")),
            _ => Err(format!("{}: an argument past the chain", step.node)),
        };
        let args = step.args.iter().map(arg).collect::<Result<Vec<_>, _>>()?;
        let expr = match (&step.op, args.as_slice()) {
            (Op::Cast(_), [x]) => x.clone(),
            (op, [x]) => {
                let (name, alpha, beta) = unary_name(op).ok_or_else(|| format!("{}: not fusable", step.node))?;
                format!("U_{name}()({x}, {}, {})", float_lit(alpha), float_lit(beta))
            }
            (op, [a, b]) => {
                let name = binary_name(op).ok_or_else(|| format!("{}: not fusable", step.node))?;
                format!("V_{name}()({a}, {b})")
            }
            _ => return Err(format!("{}: {} arguments in a fused step", step.node, args.len())),
        };
        let _ = writeln!(s, "        const float s{j} = mpc_keep(round_to<{}>({expr}));", ctype(step.dtype)?);
    }
    for (j, &k) in chain.outputs.iter().enumerate() {
        if k >= chain.steps.len() {
            return Err("an output past the chain".into());
        }
        let _ = writeln!(s, "        st(out{j}, i, s{k});");
    }
    let _ = writeln!(s, "    }}");
    let _ = writeln!(s, "}}");
    Ok(s)
}

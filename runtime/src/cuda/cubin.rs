//! Each kernel's parameter layout, read from a cubin (the ELF64 file `nvrtcGetCUBIN` returns): the
//! offset and size of every parameter in the kernel's parameter buffer, and the buffer's size. The
//! host's argument list for a kernel can then be checked against what the kernel declares with no
//! GPU: an argument missing, extra, or of the wrong size fails a test instead of a launch.
//!
//! A kernel `K` has a section `.nv.info.K`: a sequence of records on a 4-byte grid, each a format
//! byte, an attribute byte and a value. Formats 0x01 (no value), 0x02 (one byte) and 0x03 (two
//! bytes) take 4 bytes in all; format 0x04 is followed by a u16 payload size and that many bytes.
//! Two attributes give the layout: 0x17 (KPARAM_INFO, one per parameter: u32 index, u16 ordinal,
//! u16 offset, u32 whose bits 18.. are the size) and 0x0a (PARAM_CBANK: u32 symbol, u16 constant
//! bank offset, u16 parameter buffer size); 0x19 (CBANK_PARAM_SIZE, a u16) repeats the size.
//!
//! Every read is bounds-checked: a truncated or malformed file is an `Err`, never a panic.

use std::collections::BTreeMap;

/// One kernel parameter: its byte offset in the parameter buffer and its size in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Param {
    pub offset: u32,
    pub size: u32,
}

/// A kernel's parameters in declaration order, and the parameter buffer's total size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelParams {
    pub params: Vec<Param>,
    pub total: u32,
}

const EM_CUDA: u16 = 190;
const SHT_NULL: u32 = 0;
const SHT_NOBITS: u32 = 8;
const SHN_XINDEX: u16 = 0xffff;

const EIFMT_NVAL: u8 = 0x01;
const EIFMT_BVAL: u8 = 0x02;
const EIFMT_HVAL: u8 = 0x03;
const EIFMT_SVAL: u8 = 0x04;
const EIATTR_PARAM_CBANK: u8 = 0x0a;
const EIATTR_KPARAM_INFO: u8 = 0x17;
const EIATTR_CBANK_PARAM_SIZE: u8 = 0x19;

const INFO_PREFIX: &[u8] = b".nv.info.";

/// `len` bytes of `data` from `at`, if they are all there.
fn slice(data: &[u8], at: u64, len: u64) -> Option<&[u8]> {
    let end = usize::try_from(at.checked_add(len)?).ok()?;
    data.get(usize::try_from(at).ok()?..end)
}

fn le<const N: usize>(data: &[u8], at: usize) -> Option<[u8; N]> {
    data.get(at..at.checked_add(N)?)?.try_into().ok()
}

fn u16_at(data: &[u8], at: usize) -> Option<u16> {
    le(data, at).map(u16::from_le_bytes)
}

fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    le(data, at).map(u32::from_le_bytes)
}

fn u64_at(data: &[u8], at: usize) -> Option<u64> {
    le(data, at).map(u64::from_le_bytes)
}

/// The fields of a section header that are read here.
struct Section {
    name: u32,
    kind: u32,
    offset: u64,
    size: u64,
    link: u32,
}

fn section_header(cubin: &[u8], at: u64) -> Option<Section> {
    let h = slice(cubin, at, 64)?;
    Some(Section {
        name: u32_at(h, 0)?,
        kind: u32_at(h, 4)?,
        offset: u64_at(h, 24)?,
        size: u64_at(h, 32)?,
        link: u32_at(h, 40)?,
    })
}

/// The section headers and the index of the section name table, after checking that the ELF
/// header, the program header table, every segment and every section lie inside the file.
fn sections(cubin: &[u8]) -> Result<(Vec<Section>, usize), String> {
    let len = cubin.len();
    if len < 64 {
        return Err(format!("cubin: {len} bytes, shorter than an ELF64 header"));
    }
    if !cubin.starts_with(b"\x7fELF") {
        return Err("cubin: not an ELF file (no \\x7fELF magic)".into());
    }
    if cubin[4] != 2 || cubin[5] != 1 {
        return Err(format!("cubin: not a little-endian ELF64 file (class {}, data {})", cubin[4], cubin[5]));
    }
    let field = |at: usize| u16_at(cubin, at).ok_or("cubin: ELF header cut off");
    let machine = field(0x12)?;
    if machine != EM_CUDA {
        return Err(format!("cubin: ELF machine {machine}, not CUDA ({EM_CUDA})"));
    }
    let phoff = u64_at(cubin, 0x20).ok_or("cubin: ELF header cut off")?;
    let shoff = u64_at(cubin, 0x28).ok_or("cubin: ELF header cut off")?;
    let (phentsize, phnum) = (field(0x36)?, field(0x38)?);
    let (shentsize, shnum, shstrndx) = (field(0x3a)?, field(0x3c)?, field(0x3e)?);

    if phnum > 0 {
        if phentsize < 56 {
            return Err(format!("cubin: program headers of {phentsize} bytes, less than ELF64's 56"));
        }
        let table = u64::from(phentsize) * u64::from(phnum);
        slice(cubin, phoff, table).ok_or_else(|| {
            format!("cubin: the program header table ({phnum} x {phentsize} bytes at {phoff}) runs past the end of the {len}-byte file")
        })?;
        for i in 0..u64::from(phnum) {
            let h = slice(cubin, phoff + i * u64::from(phentsize), 56).ok_or("cubin: program header cut off")?;
            let (offset, size) = (u64_at(h, 8), u64_at(h, 32));
            let (Some(offset), Some(size)) = (offset, size) else { return Err("cubin: program header cut off".into()) };
            if slice(cubin, offset, size).is_none() {
                return Err(format!(
                    "cubin: segment {i} ({size} bytes at {offset}) runs past the end of the {len}-byte file"
                ));
            }
        }
    }

    if shoff == 0 {
        return Err("cubin: no section header table".into());
    }
    if shentsize < 64 {
        return Err(format!("cubin: section headers of {shentsize} bytes, less than ELF64's 64"));
    }
    let first = section_header(cubin, shoff).ok_or_else(|| {
        format!("cubin: the section header table (at {shoff}) starts past the end of the {len}-byte file")
    })?;
    // More than 0xff00 sections: the count and the name table's index are in section 0.
    let count = if shnum == 0 { first.size } else { u64::from(shnum) };
    let names = if shstrndx == SHN_XINDEX { u64::from(first.link) } else { u64::from(shstrndx) };
    let table = count.checked_mul(u64::from(shentsize)).ok_or("cubin: section header count overflows")?;
    slice(cubin, shoff, table).ok_or_else(|| {
        format!("cubin: the section header table ({count} x {shentsize} bytes at {shoff}) runs past the end of the {len}-byte file")
    })?;
    let mut out = Vec::new();
    for i in 0..count {
        // In bounds: the whole table is.
        let s = section_header(cubin, shoff + i * u64::from(shentsize)).ok_or("cubin: section header cut off")?;
        if s.kind != SHT_NULL && s.kind != SHT_NOBITS && slice(cubin, s.offset, s.size).is_none() {
            return Err(format!(
                "cubin: section {i} ({} bytes at {}) runs past the end of the {len}-byte file",
                s.size, s.offset
            ));
        }
        out.push(s);
    }
    if names == 0 || names >= count {
        return Err(format!("cubin: section name table index {names} is not a section (there are {count})"));
    }
    Ok((out, names as usize))
}

/// A section's bytes (in bounds: [`sections`] checked them).
fn data<'a>(cubin: &'a [u8], s: &Section) -> &'a [u8] {
    if s.kind == SHT_NOBITS {
        return &[];
    }
    slice(cubin, s.offset, s.size).unwrap_or_default()
}

/// Every kernel of a cubin by name. Err: one line saying what is malformed.
pub fn kernels(cubin: &[u8]) -> Result<BTreeMap<String, KernelParams>, String> {
    let (sections, names) = sections(cubin)?;
    let strtab = data(cubin, &sections[names]);
    let mut out = BTreeMap::new();
    for (i, s) in sections.iter().enumerate() {
        if s.kind == SHT_NULL {
            continue;
        }
        let name = usize::try_from(s.name)
            .ok()
            .and_then(|at| strtab.get(at..))
            .and_then(|rest| rest.split(|&b| b == 0).next().filter(|n| n.len() < rest.len()))
            .ok_or_else(|| format!("cubin: section {i}'s name (at {}) is not in the section name table", s.name))?;
        let Some(kernel) = name.strip_prefix(INFO_PREFIX) else { continue };
        let kernel = std::str::from_utf8(kernel)
            .ok()
            .filter(|k| !k.is_empty())
            .ok_or_else(|| format!("cubin: section {i}: {:?} names no kernel", String::from_utf8_lossy(name)))?;
        if s.kind == SHT_NOBITS {
            return Err(format!("cubin: section .nv.info.{kernel} has no data"));
        }
        let params = kernel_params(data(cubin, s)).map_err(|e| format!("cubin: .nv.info.{kernel}: {e}"))?;
        if out.insert(kernel.to_string(), params).is_some() {
            return Err(format!("cubin: two .nv.info.{kernel} sections"));
        }
    }
    Ok(out)
}

/// The layout one `.nv.info.K` section gives.
fn kernel_params(info: &[u8]) -> Result<KernelParams, String> {
    let mut by_ordinal: BTreeMap<u16, Param> = BTreeMap::new();
    let (mut cbank, mut cbank_size) = (None, None);
    let mut at = 0usize;
    while at < info.len() {
        let cut = || format!("the record at {at:#x} runs past the section's end ({} bytes)", info.len());
        let head = info.get(at..at + 4).ok_or_else(cut)?;
        let (format, attribute) = (head[0], head[1]);
        let value = match format {
            EIFMT_NVAL | EIFMT_BVAL | EIFMT_HVAL => &head[2..4],
            EIFMT_SVAL => {
                let n = usize::from(u16::from_le_bytes([head[2], head[3]]));
                info.get(at + 4..at + 4 + n).ok_or_else(cut)?
            }
            _ => return Err(format!("the record at {at:#x} has an unknown format {format:#04x}")),
        };
        match (attribute, format) {
            (EIATTR_KPARAM_INFO, EIFMT_SVAL) if value.len() == 12 => {
                let ordinal = u16::from_le_bytes([value[4], value[5]]);
                let offset = u32::from(u16::from_le_bytes([value[6], value[7]]));
                let size = u32::from_le_bytes([value[8], value[9], value[10], value[11]]) >> 18;
                if by_ordinal.insert(ordinal, Param { offset, size }).is_some() {
                    return Err(format!("parameter {ordinal} has two KPARAM_INFO records"));
                }
            }
            (EIATTR_PARAM_CBANK, EIFMT_SVAL) if value.len() == 8 => {
                let total = u32::from(u16::from_le_bytes([value[6], value[7]]));
                if cbank.replace(total).is_some() {
                    return Err("two PARAM_CBANK records".into());
                }
            }
            (EIATTR_CBANK_PARAM_SIZE, EIFMT_HVAL) => {
                let total = u32::from(u16::from_le_bytes([value[0], value[1]]));
                if cbank_size.replace(total).is_some() {
                    return Err("two CBANK_PARAM_SIZE records".into());
                }
            }
            (EIATTR_KPARAM_INFO | EIATTR_PARAM_CBANK | EIATTR_CBANK_PARAM_SIZE, _) => {
                return Err(format!(
                    "the record at {at:#x} (attribute {attribute:#04x}) has format {format:#04x} and {} value bytes",
                    value.len()
                ));
            }
            _ => {}
        }
        at += if format == EIFMT_SVAL { 4 + value.len() } else { 4 };
    }
    let mut params = Vec::with_capacity(by_ordinal.len());
    for (i, (&ordinal, &p)) in by_ordinal.iter().enumerate() {
        if usize::from(ordinal) != i {
            return Err(format!(
                "parameter {i} has no KPARAM_INFO record (ordinals {:?})",
                by_ordinal.keys().collect::<Vec<_>>()
            ));
        }
        params.push(p);
    }
    let total = match (cbank, cbank_size) {
        (Some(a), Some(b)) if a != b => {
            return Err(format!("PARAM_CBANK says {a} parameter bytes, CBANK_PARAM_SIZE {b}"));
        }
        (Some(t), _) | (None, Some(t)) => t,
        (None, None) if params.is_empty() => 0,
        (None, None) => return Err(format!("{} parameters but no parameter buffer size", params.len())),
    };
    let mut end = 0;
    for (i, p) in params.iter().enumerate() {
        if p.offset < end {
            return Err(format!("parameter {i} at offset {} overlaps the one before it (ends at {end})", p.offset));
        }
        end = p.offset + p.size;
        if end > total {
            return Err(format!("parameter {i} ({} bytes at {}) ends past the {total}-byte buffer", p.size, p.offset));
        }
    }
    Ok(KernelParams { params, total })
}

#[cfg(test)]
mod tests {
    use super::*;

    // ---- cubins built here: the records as NVRTC writes them ----

    fn kparam(ordinal: u16, offset: u16, size: u32) -> Vec<u8> {
        let mut r = vec![EIFMT_SVAL, EIATTR_KPARAM_INFO, 12, 0, 0, 0, 0, 0];
        r.extend(ordinal.to_le_bytes());
        r.extend(offset.to_le_bytes());
        r.extend((size << 18 | 0x1f000).to_le_bytes());
        r
    }

    fn cbank(total: u16) -> Vec<u8> {
        let mut r = vec![EIFMT_SVAL, EIATTR_PARAM_CBANK, 8, 0, 0x83, 0, 0, 0, 0x10, 0x02];
        r.extend(total.to_le_bytes());
        r
    }

    fn hval(attribute: u8, v: u16) -> Vec<u8> {
        let [a, b] = v.to_le_bytes();
        vec![EIFMT_HVAL, attribute, a, b]
    }

    /// An ELF64 CUDA file: section 0 null, 1 the name table, then `sections` (name, type, data),
    /// then the section header table; no program headers.
    fn build(sections: &[(&str, u32, Vec<u8>)]) -> Vec<u8> {
        let mut names = vec![0u8];
        let mut name_at = vec![];
        for n in [".shstrtab"].into_iter().chain(sections.iter().map(|s| s.0)) {
            name_at.push(names.len() as u32);
            names.extend(n.as_bytes());
            names.push(0);
        }
        let mut out = vec![0u8; 64];
        let mut headers = vec![[0u8; 64]];
        let mut header = |name: u32, kind: u32, offset: usize, size: usize| {
            let mut h = [0u8; 64];
            h[0..4].copy_from_slice(&name.to_le_bytes());
            h[4..8].copy_from_slice(&kind.to_le_bytes());
            h[24..32].copy_from_slice(&(offset as u64).to_le_bytes());
            h[32..40].copy_from_slice(&(size as u64).to_le_bytes());
            headers.push(h);
        };
        header(name_at[0], 3, out.len(), names.len());
        out.extend(&names);
        for (i, (_, kind, data)) in sections.iter().enumerate() {
            out.resize(out.len().next_multiple_of(4), 0);
            header(name_at[i + 1], *kind, out.len(), data.len());
            out.extend(data);
        }
        out.resize(out.len().next_multiple_of(8), 0);
        let shoff = out.len() as u64;
        for h in &headers {
            out.extend(h);
        }
        out[0..8].copy_from_slice(b"\x7fELF\x02\x01\x01\x41");
        out[0x10..0x12].copy_from_slice(&2u16.to_le_bytes());
        out[0x12..0x14].copy_from_slice(&EM_CUDA.to_le_bytes());
        out[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
        out[0x34..0x36].copy_from_slice(&64u16.to_le_bytes());
        out[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        out[0x3c..0x3e].copy_from_slice(&(headers.len() as u16).to_le_bytes());
        out[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        out
    }

    const LOPROC: u32 = 0x7000_0000;

    /// One kernel `k` with the given `.nv.info.k` records.
    fn one(records: &[Vec<u8>]) -> Vec<u8> {
        build(&[(".nv.info.k", LOPROC, records.concat())])
    }

    fn err(cubin: &[u8]) -> String {
        let e = kernels(cubin).expect_err("a malformed cubin was read");
        assert!(!e.contains('\n'), "not one line: {e}");
        e
    }

    /// (size, alignment) of each parameter → the layout C gives them.
    fn c_layout(fields: &[(u32, u32)]) -> KernelParams {
        let mut end = 0u32;
        let params = fields
            .iter()
            .map(|&(size, align)| {
                let offset = end.next_multiple_of(align);
                end = offset + size;
                Param { offset, size }
            })
            .collect();
        KernelParams { params, total: end }
    }

    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn records_of_every_format_are_read() {
        let cubin = build(&[
            (".nv.info", LOPROC, [hval(0x2f, 7), vec![EIFMT_SVAL, 0x11, 4, 0, 1, 2, 3, 4]].concat()),
            (
                ".nv.info.k",
                LOPROC,
                [
                    vec![EIFMT_SVAL, 0x37, 4, 0, 0x82, 0, 0, 0],
                    kparam(2, 16, 4),
                    vec![EIFMT_NVAL, 0x50, 0, 0],
                    kparam(0, 0, 8),
                    vec![EIFMT_BVAL, 0x4c, 1, 0],
                    kparam(1, 8, 8),
                    hval(EIATTR_CBANK_PARAM_SIZE, 20),
                    cbank(20),
                ]
                .concat(),
            ),
            (".nv.info.empty", LOPROC, hval(0x1b, 0xff)),
            (".text.k", 1, vec![0xff; 16]),
            (".nv.shared.k", SHT_NOBITS, vec![]),
        ]);
        let k = kernels(&cubin).unwrap();
        assert_eq!(k.len(), 2, "{k:?}");
        assert_eq!(k["k"], c_layout(&[(8, 8), (8, 8), (4, 4)]));
        assert_eq!(k["empty"], KernelParams { params: vec![], total: 0 });
    }

    #[test]
    fn malformed_cubins_are_errors() {
        assert!(err(&[]).contains("shorter"));
        assert!(err(&[0x7f, b'E', b'L', b'F']).contains("shorter"));
        assert!(err(&[0u8; 64]).contains("magic"));
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for n in [64, 100, 4096] {
            let garbage: Vec<u8> = (0..n).map(|_| xorshift(&mut rng) as u8).collect();
            err(&garbage);
        }

        let good = one(&[kparam(0, 0, 8), kparam(1, 8, 4), cbank(12)]);
        assert_eq!(kernels(&good).unwrap()["k"], c_layout(&[(8, 8), (4, 4)]));
        for n in 0..good.len() {
            err(&good[..n]);
        }
        let mut elf32 = good.clone();
        elf32[4] = 1;
        assert!(err(&elf32).contains("ELF64"));
        let mut big = good.clone();
        big[5] = 2;
        assert!(err(&big).contains("little-endian"));
        let mut host = good.clone();
        host[0x12] = 62;
        assert!(err(&host).contains("machine"));

        // The section header of `.nv.info.k` (section 2) pointing past the end, or at an offset
        // whose end overflows; the header table itself out of range; a bad name table index.
        let shoff = u64::from_le_bytes(good[0x28..0x30].try_into().unwrap()) as usize;
        let patch = |at: usize, v: u64| {
            let mut c = good.clone();
            c[at..at + 8].copy_from_slice(&v.to_le_bytes());
            c
        };
        let len = good.len() as u64;
        assert!(err(&patch(shoff + 2 * 64 + 24, len)).contains("past the end"));
        assert!(err(&patch(shoff + 2 * 64 + 24, u64::MAX - 4)).contains("past the end"));
        assert!(err(&patch(shoff + 2 * 64 + 32, len)).contains("past the end"));
        assert!(err(&patch(0x28, len - 64)).contains("past the end"));
        assert!(err(&patch(0x28, u64::MAX)).contains("past the end"));
        assert!(err(&patch(0x28, 0)).contains("no section header"));
        let mut names = good.clone();
        names[0x3e] = 9;
        assert!(err(&names).contains("name table index"));
        let mut name = good.clone();
        name[shoff + 2 * 64..shoff + 2 * 64 + 4].copy_from_slice(&0xffffu32.to_le_bytes());
        assert!(err(&name).contains("name"));
        let mut phdrs = good.clone();
        phdrs[0x36] = 56;
        phdrs[0x38] = 1;
        phdrs[0x20..0x28].copy_from_slice(&(len - 8).to_le_bytes());
        assert!(err(&phdrs).contains("program header table"));

        // Records.
        assert!(err(&one(&[kparam(0, 0, 8), kparam(2, 8, 8), cbank(16)])).contains("parameter 1 has no"));
        assert!(err(&one(&[kparam(1, 0, 8), cbank(8)])).contains("parameter 0 has no"));
        assert!(err(&one(&[kparam(0, 0, 8), kparam(0, 8, 8), cbank(16)])).contains("two KPARAM_INFO"));
        assert!(err(&one(&[kparam(0, 0, 8), cbank(8), cbank(8)])).contains("two PARAM_CBANK"));
        assert!(err(&one(&[kparam(0, 0, 8), cbank(8), vec![5, 0x50, 0, 0]])).contains("unknown format"));
        assert!(err(&one(&[kparam(0, 0, 8), cbank(8), vec![EIFMT_HVAL, 0x50]])).contains("runs past"));
        assert!(err(&one(&[kparam(0, 0, 8), cbank(8), vec![EIFMT_SVAL, 0x50, 8, 0, 0, 0]])).contains("runs past"));
        assert!(err(&one(&[kparam(0, 0, 8), cbank(8), vec![EIFMT_SVAL, 0x50, 4, 0]])).contains("runs past"));
        assert!(err(&one(&[kparam(0, 0, 8)[..12].to_vec()])).contains("runs past"));
        let mut short = kparam(0, 0, 8)[..12].to_vec();
        short[2] = 8;
        assert!(err(&one(&[short, cbank(8)])).contains("value bytes"));
        assert!(err(&one(&[kparam(0, 0, 8), hval(EIATTR_KPARAM_INFO, 0), cbank(8)])).contains("value bytes"));
        assert!(err(&one(&[kparam(0, 0, 8)])).contains("no parameter buffer size"));
        assert!(err(&one(&[kparam(0, 0, 8), cbank(8), hval(EIATTR_CBANK_PARAM_SIZE, 16)])).contains("says"));
        assert!(err(&one(&[kparam(0, 0, 8), kparam(1, 4, 8), cbank(16)])).contains("overlaps"));
        assert!(err(&one(&[kparam(0, 0, 8), kparam(1, 8, 8), cbank(12)])).contains("past the 12-byte buffer"));
        assert!(kernels(&one(&[kparam(0, 0, 8), hval(EIATTR_CBANK_PARAM_SIZE, 8)])).is_ok());
        let two = build(&[(".nv.info.k", LOPROC, cbank(0)), (".nv.info.k", LOPROC, cbank(0))]);
        assert!(err(&two).contains("two .nv.info.k"));
        assert!(err(&build(&[(".nv.info.", LOPROC, cbank(0))])).contains("names no kernel"));
        assert!(err(&build(&[(".nv.info.k", SHT_NOBITS, vec![])])).contains("no data"));

        // Random bytes written anywhere: an answer or an Err, never a panic.
        for _ in 0..20_000 {
            let mut c = good.clone();
            for _ in 0..1 + xorshift(&mut rng) % 4 {
                let at = (xorshift(&mut rng) % len) as usize;
                c[at] = xorshift(&mut rng) as u8;
            }
            let _ = kernels(&c);
        }
    }

    // ---- the real kernels, compiled by NVRTC ----

    use crate::cuda::nvrtc;

    /// Every family compiled for sm_90 with ptxas's report (cubin, log), or None (printed) when
    /// NVRTC cannot be used here and MPC_REQUIRE_NVRTC is not set.
    fn compiled() -> Option<&'static [(&'static str, nvrtc::Compiled)]> {
        static COMPILED: std::sync::OnceLock<Result<Vec<(&str, nvrtc::Compiled)>, String>> = std::sync::OnceLock::new();
        let got = COMPILED.get_or_init(|| {
            nvrtc::version().and_then(|_| nvrtc::include_dir()).map_err(|e| e.to_string())?;
            Ok(nvrtc::FAMILIES
                .iter()
                .map(|&(family, source)| {
                    (family, nvrtc::compile(family, source, "sm_90", true).unwrap_or_else(|e| panic!("{e}")))
                })
                .collect())
        });
        match got {
            Ok(c) => Some(c.as_slice()),
            Err(e) if std::env::var_os("MPC_REQUIRE_NVRTC").is_none() => {
                eprintln!("skipped: {e}");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn every_kernel_has_the_layout_its_declaration_gives() {
        let Some(compiled) = compiled() else { return };
        const PTR: (u32, u32) = (8, 8);
        const I64: (u32, u32) = (8, 8);
        const F32: (u32, u32) = (4, 4);
        const I32: (u32, u32) = (4, 4);
        const DIMS8: (u32, u32) = (64, 8);
        const WINDOW3: (u32, u32) = (176, 8);
        let mut all = BTreeMap::new();
        for (family, c) in compiled {
            let k = kernels(&c.cubin).unwrap_or_else(|e| panic!("{family}: {e}"));
            let reported = nvrtc::kernel_reports(&c.log);
            assert!(!reported.is_empty(), "{family}: no kernels in the ptxas report");
            for r in &reported {
                assert!(k.contains_key(&r.name), "{family}: {} is in ptxas's report, not in the cubin", r.name);
            }
            println!("cubin: {family}: {} kernels, {} in ptxas's report", k.len(), reported.len());
            all.extend(k);
        }

        let loss_scale = &all["train_loss_scale_update"];
        let offsets: Vec<u32> = loss_scale.params.iter().map(|p| p.offset).collect();
        let sizes: Vec<u32> = loss_scale.params.iter().map(|p| p.size).collect();
        assert_eq!(offsets, [0, 8, 16, 24, 32, 40, 44, 48, 56, 60]);
        assert_eq!(sizes, [8, 8, 8, 8, 8, 4, 4, 8, 4, 4]);
        assert_eq!(loss_scale.total, 64);
        // (const float*, const long long*, const unsigned char*, float*, long long*, float, float,
        //  long long, float, float)
        assert_eq!(*loss_scale, c_layout(&[PTR, PTR, PTR, PTR, PTR, F32, F32, I64, F32, F32]));

        // (const float*, const float*, float*, long long, int, Dims8, Strides8, Strides8): the
        // int at 32, Dims8 at 40, the strides at 104 and 168.
        let add = &all["elementwise_add_f32"];
        assert_eq!(*add, c_layout(&[PTR, PTR, PTR, I64, I32, DIMS8, DIMS8, DIMS8]));
        assert_eq!(add.params[4], Param { offset: 32, size: 4 });
        assert_eq!(add.params[5], Param { offset: 40, size: 64 });
        assert_eq!(add.total, 232);

        // (const T*, T*, long long planes, Window3, int count_include_pad)
        let avg = &all["pool_avg_f32"];
        assert_eq!(*avg, c_layout(&[PTR, PTR, I64, WINDOW3, I32]));
        assert_eq!(avg.params[3], Param { offset: 24, size: 176 });
        // (const T*, T*, long long* indices, long long planes, Window3, int storage_order)
        assert_eq!(all["pool_max_f32"], c_layout(&[PTR, PTR, PTR, I64, WINDOW3, I32]));
        let windows =
            all.iter().filter(|(n, _)| n.starts_with("pool_")).filter(|(_, k)| k.params.iter().any(|p| p.size == 176));
        assert_eq!(windows.count(), all.keys().filter(|n| n.starts_with("pool_")).count());
    }

    #[test]
    fn truncated_and_damaged_real_cubins_are_errors() {
        let Some(compiled) = compiled() else { return };
        for (family, c) in compiled {
            for n in 0..c.cubin.len() {
                assert!(kernels(&c.cubin[..n]).is_err(), "{family}: the first {n} bytes were read as a cubin");
            }
        }
        let (_, train) = compiled.iter().find(|(f, _)| *f == "train").expect("train");
        let cubin: &[u8] = &train.cubin;
        let shoff = u64::from_le_bytes(cubin[0x28..0x30].try_into().unwrap());
        let shnum = u16::from_le_bytes(cubin[0x3c..0x3e].try_into().unwrap()) as u64;
        let len = cubin.len() as u64;
        // Every section's offset moved to the end of the file, one at a time.
        let (sections, _) = sections(cubin).unwrap();
        let mut moved = 0;
        for (i, s) in sections.iter().enumerate() {
            if s.kind == SHT_NULL || s.kind == SHT_NOBITS || s.size == 0 {
                continue;
            }
            let at = (shoff + i as u64 * 64 + 24) as usize;
            let mut c = cubin.to_vec();
            c[at..at + 8].copy_from_slice(&len.to_le_bytes());
            assert!(err(&c).contains("past the end"), "section {i}");
            moved += 1;
        }
        assert!(moved > 0);
        // Random bytes written in the section headers and the .nv.info sections.
        let info: Vec<&Section> = sections.iter().filter(|s| s.kind == LOPROC && s.size > 0).collect();
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..3000 {
            let mut c = cubin.to_vec();
            for _ in 0..1 + xorshift(&mut rng) % 4 {
                let at = if xorshift(&mut rng) % 2 == 0 {
                    shoff + xorshift(&mut rng) % (shnum * 64)
                } else {
                    let s = info[(xorshift(&mut rng) % info.len() as u64) as usize];
                    s.offset + xorshift(&mut rng) % s.size
                };
                c[at as usize] = xorshift(&mut rng) as u8;
            }
            let _ = kernels(&c);
        }
        // Garbage after a real ELF header.
        let mut c = cubin[..64].to_vec();
        c.extend((0..4096).map(|_| xorshift(&mut rng) as u8));
        err(&c);
    }
}

//! safetensors files: an 8-byte little-endian header length, a JSON header mapping each tensor
//! name to `{dtype, shape, data_offsets}` (plus an optional `__metadata__` map of strings),
//! then the tensor bytes, row-major and little-endian.
//!
//! [`SafetensorsFile::open`] memory-maps the file and parses the header; tensor bytes stay in
//! the map until [`SafetensorsFile::to_f32`] converts one. Every tensor's byte range is checked
//! at open time against the data section, and for dtypes of known width against its shape, so
//! a truncated or inconsistent file fails at open, naming the file and the tensor. Shapes are
//! in safetensors order: the last dim varies fastest, so a `[rows, cols]` matrix is row-major
//! `rows × cols` (a Hugging Face linear weight is `[out_features, in_features]`).

use crate::error::{Error, Result};
use rayon::prelude::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Largest header this reader accepts (the format's reference implementation uses 100 MB).
const MAX_HEADER: u64 = 100 << 20;
/// Elements converted per parallel task.
const CHUNK: usize = 1 << 16;

/// Element type of a tensor. Only the float types convert to f32; the rest are named so that
/// an error can say what the file holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16 (the upper half of a binary32).
    BF16,
    /// Any other dtype, by its safetensors name (`I64`, `F8_E4M3`, ...).
    Other(String),
}

impl Dtype {
    fn parse(name: &str) -> Self {
        match name {
            "F32" => Self::F32,
            "F16" => Self::F16,
            "BF16" => Self::BF16,
            other => Self::Other(other.to_string()),
        }
    }

    /// The safetensors name.
    pub fn name(&self) -> &str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Other(name) => name,
        }
    }

    /// Bytes per element, for the dtypes whose width is fixed and known.
    fn size(&self) -> Option<usize> {
        match self.name() {
            "F64" | "I64" | "U64" => Some(8),
            "F32" | "I32" | "U32" => Some(4),
            "F16" | "BF16" | "I16" | "U16" => Some(2),
            "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => Some(1),
            _ => None,
        }
    }
}

/// One tensor's header entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Element type.
    pub dtype: Dtype,
    /// Dims, slowest-varying first.
    pub shape: Vec<usize>,
    /// Byte range within the data section.
    data: Range<usize>,
}

impl TensorInfo {
    /// Number of elements (checked at open time not to overflow).
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True for a tensor with a zero dim.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A memory-mapped safetensors file.
pub struct SafetensorsFile {
    path: PathBuf,
    map: memmap2::Mmap,
    data_start: usize,
    tensors: BTreeMap<String, TensorInfo>,
}

impl SafetensorsFile {
    /// Memory-maps and parses the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only; the checkpoint is a file the caller chose to load and is
        // not expected to change while mapped (as with every mmap-based model loader).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let (tensors, data_start) = parse_header(&map).map_err(|reason| malformed(path, reason))?;
        Ok(Self {
            path: path.to_path_buf(),
            map,
            data_start,
            tensors,
        })
    }

    /// The file this was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The header entry of a tensor.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The raw little-endian bytes of a tensor.
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self
            .tensor(name)
            .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
        let range = self.data_start + info.data.start..self.data_start + info.data.end;
        Ok(&self.map[range])
    }

    /// Converts a tensor of dtype F32, F16 or BF16 to f32, row-major.
    pub fn to_f32(&self, name: &str) -> Result<Vec<f32>> {
        let info = self
            .tensor(name)
            .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
        let mut out = vec![0f32; info.len()];
        convert(&info.dtype, self.bytes(name)?, &mut out).map_err(|dtype| {
            Error::UnsupportedDtype {
                name: name.to_string(),
                dtype,
            }
        })?;
        Ok(out)
    }
}

fn malformed(path: &Path, reason: String) -> Error {
    Error::MalformedSafetensors {
        path: path.to_path_buf(),
        reason,
    }
}

/// Parses the header of a safetensors image: the tensor table and where the data starts.
fn parse_header(
    bytes: &[u8],
) -> std::result::Result<(BTreeMap<String, TensorInfo>, usize), String> {
    let Some(len_bytes) = bytes.get(..8) else {
        return Err(format!(
            "{} bytes, shorter than the 8-byte header length",
            bytes.len()
        ));
    };
    let header_len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
    let available = bytes.len() as u64 - 8;
    if header_len > available || header_len > MAX_HEADER {
        return Err(format!(
            "header length {header_len} exceeds the file ({available} bytes after the length) \
             or the {MAX_HEADER}-byte limit"
        ));
    }
    let data_start = 8 + header_len as usize;
    let header: Value = serde_json::from_slice(&bytes[8..data_start])
        .map_err(|e| format!("header is not JSON: {e}"))?;
    let Value::Object(entries) = header else {
        return Err("header is not a JSON object".into());
    };
    let data_len = bytes.len() - data_start;
    let mut tensors = BTreeMap::new();
    for (name, entry) in entries {
        if name == "__metadata__" {
            continue;
        }
        let info = parse_entry(&entry, data_len).map_err(|e| format!("tensor `{name}`: {e}"))?;
        tensors.insert(name, info);
    }
    Ok((tensors, data_start))
}

fn parse_entry(entry: &Value, data_len: usize) -> std::result::Result<TensorInfo, String> {
    let dtype = entry
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or("no string `dtype`")?;
    let dtype = Dtype::parse(dtype);
    let shape = entry
        .get("shape")
        .and_then(Value::as_array)
        .ok_or("no array `shape`")?
        .iter()
        .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
        .collect::<Option<Vec<usize>>>()
        .ok_or("`shape` is not a list of sizes")?;
    let offsets = entry
        .get("data_offsets")
        .and_then(Value::as_array)
        .filter(|o| o.len() == 2)
        .and_then(|o| {
            let at = |i: usize| o[i].as_u64().and_then(|v| usize::try_from(v).ok());
            Some(at(0)?..at(1)?)
        })
        .ok_or("`data_offsets` is not a pair of offsets")?;
    if offsets.start > offsets.end || offsets.end > data_len {
        return Err(format!(
            "data_offsets {offsets:?} outside the {data_len}-byte data section"
        ));
    }
    let elements = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| format!("shape {shape:?} has too many elements"))?;
    if let Some(size) = dtype.size() {
        if elements.checked_mul(size) != Some(offsets.len()) {
            return Err(format!(
                "shape {shape:?} of {} needs {} bytes, data_offsets give {}",
                dtype.name(),
                elements as u128 * size as u128,
                offsets.len()
            ));
        }
    }
    Ok(TensorInfo {
        dtype,
        shape,
        data: offsets,
    })
}

/// Converts little-endian `bytes` of `dtype` into `out`; on an unsupported dtype returns its
/// name. `bytes` holds exactly `out.len()` elements (checked at open time).
fn convert(dtype: &Dtype, bytes: &[u8], out: &mut [f32]) -> std::result::Result<(), String> {
    fn run<const W: usize>(bytes: &[u8], out: &mut [f32], f: impl Fn([u8; W]) -> f32 + Sync) {
        out.par_chunks_mut(CHUNK)
            .zip(bytes.par_chunks(CHUNK * W))
            .for_each(|(out, bytes)| {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(W)) {
                    *o = f(b.try_into().expect("W bytes"));
                }
            });
    }
    match dtype {
        Dtype::F32 => run(bytes, out, f32::from_le_bytes),
        Dtype::F16 => run(bytes, out, |b| {
            half::f16::from_bits(u16::from_le_bytes(b)).to_f32()
        }),
        Dtype::BF16 => run(bytes, out, |b| {
            half::bf16::from_bits(u16::from_le_bytes(b)).to_f32()
        }),
        Dtype::Other(name) => return Err(name.clone()),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors image with the given header JSON and data bytes.
    fn image(header: &str, data: &[u8]) -> Vec<u8> {
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn parses_and_converts_every_float_dtype() {
        let mut data = Vec::new();
        data.extend(1.5f32.to_le_bytes());
        data.extend((-2.0f32).to_le_bytes());
        data.extend(half::f16::from_f32(0.25).to_bits().to_le_bytes());
        data.extend(half::bf16::from_f32(-3.0).to_bits().to_le_bytes());
        let header = r#"{"__metadata__":{"format":"pt"},
            "a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
            "b":{"dtype":"F16","shape":[1,1],"data_offsets":[8,10]},
            "c":{"dtype":"BF16","shape":[1],"data_offsets":[10,12]}}"#;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        std::fs::write(&path, image(header, &data)).unwrap();
        let file = SafetensorsFile::open(&path).unwrap();
        assert_eq!(file.names().collect::<Vec<_>>(), ["a", "b", "c"]);
        assert_eq!(file.to_f32("a").unwrap(), [1.5, -2.0]);
        assert_eq!(file.tensor("b").unwrap().shape, [1, 1]);
        assert_eq!(file.to_f32("b").unwrap(), [0.25]);
        assert_eq!(file.to_f32("c").unwrap(), [-3.0]);
        let e = file.to_f32("d").unwrap_err();
        assert!(matches!(e, Error::MissingTensor(ref n) if n == "d"), "{e}");
    }

    #[test]
    fn conversion_is_exact_across_chunks() {
        let n = CHUNK * 2 + 3;
        let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 7.0).collect();
        let bytes: Vec<u8> = values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect();
        let mut out = vec![0f32; n];
        convert(&Dtype::BF16, &bytes, &mut out).unwrap();
        for (v, o) in values.iter().zip(&out) {
            assert_eq!(half::bf16::from_f32(*v).to_f32(), *o);
        }
    }

    #[test]
    fn refuses_unsupported_dtypes_by_name() {
        let header = r#"{"ids":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}"#;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        std::fs::write(&path, image(header, &[0; 4])).unwrap();
        let e = SafetensorsFile::open(&path)
            .unwrap()
            .to_f32("ids")
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor `ids` has unsupported dtype I32 (supported: F32, F16, BF16)"
        );
    }

    #[test]
    fn rejects_malformed_headers() {
        let cases: [(Vec<u8>, &str); 6] = [
            (vec![1, 2, 3], "shorter than the 8-byte header length"),
            (image("{}", b"")[..9].to_vec(), "exceeds the file"),
            (image("[1]", b""), "not a JSON object"),
            (
                image(
                    r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
                    &[0; 8],
                ),
                "tensor `w`: shape [3] of F32 needs 12 bytes, data_offsets give 8",
            ),
            (
                image(
                    r#"{"w":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}}"#,
                    &[0; 4],
                ),
                "tensor `w`: data_offsets 0..8 outside the 4-byte data section",
            ),
            (
                image(
                    r#"{"w":{"dtype":"F16","shape":[-1],"data_offsets":[0,0]}}"#,
                    b"",
                ),
                "`shape` is not a list of sizes",
            ),
        ];
        for (bytes, want) in cases {
            let e = parse_header(&bytes).unwrap_err();
            assert!(e.contains(want), "{e:?} should contain {want:?}");
        }
    }
}

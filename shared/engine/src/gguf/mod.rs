//! GGUF (versions 2 and 3) model files: header, metadata, tensor infos and tensor data.
//!
//! [`GgufFile::open`] memory-maps the file and parses everything up to the tensor data; tensor
//! bytes stay in the map until [`GgufFile::dequantize`] turns one into f32. Every tensor's byte
//! range is checked against the file length at open time (for types whose block size is
//! known), so a truncated file fails at open, naming the tensor. Dims are in GGUF order:
//! `dims[0]` varies fastest, so a matrix with dims `[cols, rows]` is row-major `rows × cols`.

mod builder;
pub mod dequant;
mod reader;
mod types;
mod value;

pub use builder::GgufBuilder;
pub use types::GgmlType;
pub use value::{Value, ValueType};

use crate::error::{Error, Result};
use rayon::prelude::*;
use reader::Reader;
use std::collections::{BTreeMap, HashMap};
use std::ops::Deref;
use std::path::Path;

const MAGIC: u32 = 0x4655_4747; // "GGUF" read as a little-endian u32
const DEFAULT_ALIGNMENT: u64 = 32;
const ALIGNMENT_KEY: &str = "general.alignment";

/// One tensor's description from the header.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dims, fastest-varying first.
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements (checked at parse time to fit a `usize`).
    pub fn len(&self) -> u64 {
        self.dims.iter().product()
    }

    /// True for a tensor with a zero dim.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Mapped(m) => m,
            Self::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file whose tensor data is read on demand.
pub struct GgufFile {
    bytes: Bytes,
    version: u32,
    metadata: BTreeMap<String, Value>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl GgufFile {
    /// Memory-maps and parses the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only; the file is a model the caller chose to load and is not
        // expected to change while mapped (as with every mmap-based model loader).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::parse(Bytes::Mapped(map))
    }

    /// Parses a GGUF image held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(Bytes::Owned(bytes))
    }

    fn parse(bytes: Bytes) -> Result<Self> {
        let mut r = Reader::new(&bytes);
        let magic = r.u32(&|| "magic".into())?;
        if magic != MAGIC {
            return Err(Error::BadMagic(magic));
        }
        let version = r.u32(&|| "version".into())?;
        if !(2..=3).contains(&version) {
            return Err(Error::UnsupportedVersion(version));
        }
        let n_tensors = r.u64(&|| "tensor count".into())?;
        let n_kv = r.u64(&|| "metadata count".into())?;

        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(&|| format!("metadata key #{i}"))?;
            let what = || format!("metadata value `{key}`");
            let tag = r.u32(&what)?;
            let value = r.value(tag, &what)?;
            metadata.insert(key, value);
        }

        let mut tensors = Vec::new();
        let mut by_name = HashMap::new();
        for i in 0..n_tensors {
            let name = r.string(&|| format!("tensor info #{i} name"))?;
            let what = || format!("tensor info `{name}`");
            let n_dims = r.u32(&what)?;
            if n_dims > 8 {
                return Err(Error::Malformed(format!(
                    "tensor `{name}` has {n_dims} dims"
                )));
            }
            let dims = (0..n_dims)
                .map(|_| r.u64(&what))
                .collect::<Result<Vec<_>>>()?;
            let elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
            if elements.is_none_or(|n| usize::try_from(n).is_err()) {
                return Err(Error::Malformed(format!(
                    "tensor `{name}` has dims {dims:?}: too many elements"
                )));
            }
            let ggml_type = GgmlType::from_id(r.u32(&what)?);
            let offset = r.u64(&what)?;
            if by_name.insert(name.clone(), tensors.len()).is_some() {
                return Err(Error::Malformed(format!("tensor `{name}` appears twice")));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }

        let alignment = match metadata.get(ALIGNMENT_KEY) {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(Error::Malformed(format!(
                        "{ALIGNMENT_KEY} must be a power of two, got {v}"
                    )))
                }
            },
        };
        let data_offset = (r.pos() as u64).div_ceil(alignment) * alignment;

        let file = Self {
            bytes,
            version,
            metadata,
            tensors,
            by_name,
            alignment,
            data_offset,
        };
        for t in &file.tensors {
            file.check_range(t)?;
        }
        Ok(file)
    }

    /// Checks that a tensor's data lies inside the file (when its size is computable).
    fn check_range(&self, t: &TensorInfo) -> Result<()> {
        if !t.offset.is_multiple_of(self.alignment) {
            return Err(Error::Malformed(format!(
                "tensor `{}` offset {} is not a multiple of the alignment {}",
                t.name, t.offset, self.alignment
            )));
        }
        let Some(size) = t.ggml_type.bytes_for(t.len()) else {
            return Ok(()); // unknown type or ragged length: reported when dequantized
        };
        let start = self.data_offset.saturating_add(t.offset);
        let end = start.saturating_add(size);
        let len = self.bytes.len() as u64;
        if end > len {
            return Err(Error::Truncated {
                what: format!("tensor `{}` ({} {:?})", t.name, t.ggml_type, t.dims),
                start,
                end,
                len,
            });
        }
        Ok(())
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Tensor data alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset of the tensor data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// One metadata value that must be present.
    pub fn require(&self, key: &str) -> Result<&Value> {
        self.get(key)
            .ok_or_else(|| Error::MissingMetadata(key.to_string()))
    }

    /// A required non-negative integer value.
    pub fn require_u64(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| type_error(key, "a non-negative integer", v))
    }

    /// A required float value (f32 or f64 in the file).
    pub fn require_f64(&self, key: &str) -> Result<f64> {
        let v = self.require(key)?;
        v.as_f64().ok_or_else(|| type_error(key, "a float", v))
    }

    /// A required string value.
    pub fn require_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| type_error(key, "a string", v))
    }

    /// A required array of strings.
    pub fn require_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let v = self.require(key)?;
        let items = v
            .as_array()
            .ok_or_else(|| type_error(key, "an array of strings", v))?;
        items
            .iter()
            .map(|item| {
                item.as_str()
                    .ok_or_else(|| type_error(key, "an array of strings", item))
            })
            .collect()
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The info of a named tensor.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.by_name
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| Error::MissingTensor(name.to_string()))
    }

    /// The raw bytes of a named tensor.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let t = self.tensor(name)?;
        let size = t
            .ggml_type
            .bytes_for(t.len())
            .ok_or_else(|| match t.ggml_type {
                GgmlType::Other(_) => unsupported(t),
                _ => Error::Malformed(format!(
                    "tensor `{}` has {} values, not a whole number of {} blocks",
                    t.name,
                    t.len(),
                    t.ggml_type
                )),
            })?;
        let start = (self.data_offset + t.offset) as usize;
        // In range: checked by `check_range` at open.
        Ok(&self.bytes[start..start + size as usize])
    }

    /// Dequantizes a named tensor to f32, in storage order (row-major with `dims[0]` fastest).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        let bytes = self.tensor_bytes(name)?;
        let mut out = vec![0.0f32; t.len() as usize];
        let (Some(block_len), Some(block_bytes)) =
            (t.ggml_type.block_len(), t.ggml_type.block_bytes())
        else {
            return Err(unsupported(t));
        };
        // Chunks of whole blocks, dequantized in parallel.
        const BLOCKS_PER_TASK: usize = 4096;
        let ok = bytes
            .par_chunks(block_bytes * BLOCKS_PER_TASK)
            .zip(out.par_chunks_mut(block_len * BLOCKS_PER_TASK))
            .all(|(b, o)| dequant::dequantize(t.ggml_type, b, o));
        if !ok {
            return Err(unsupported(t));
        }
        Ok(out)
    }

    /// The info of a named tensor after checking its dims (GGUF order) equal `expected`.
    pub fn tensor_shaped(&self, name: &str, expected: &[u64]) -> Result<&TensorInfo> {
        let t = self.tensor(name)?;
        if t.dims != expected {
            return Err(Error::ShapeMismatch {
                name: name.to_string(),
                expected: expected.to_vec(),
                found: t.dims.clone(),
            });
        }
        Ok(t)
    }

    /// Dequantizes a named tensor after checking its dims (GGUF order) equal `expected`.
    pub fn dequantize_shaped(&self, name: &str, expected: &[u64]) -> Result<Vec<f32>> {
        self.tensor_shaped(name, expected)?;
        self.dequantize(name)
    }
}

fn type_error(key: &str, expected: &'static str, found: &Value) -> Error {
    Error::MetadataType {
        key: key.to_string(),
        expected,
        found: found.type_name().to_string(),
    }
}

fn unsupported(t: &TensorInfo) -> Error {
    Error::UnsupportedTensorType {
        name: t.name.clone(),
        ggml_type: t.ggml_type.to_string(),
    }
}

#[cfg(test)]
mod tests;

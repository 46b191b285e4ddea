//! The safetensors files of a Hugging Face checkpoint seen as one tensor namespace.
//!
//! Which files: those named by `model.safetensors.index.json` (sharded checkpoints), else
//! `model.safetensors`, else every `*.safetensors` file in the directory. Every file is
//! memory-mapped and its header parsed at open, so a missing shard, a malformed header, a
//! tensor the index places in a file that lacks it, or one name in two files fails at open,
//! naming the file and the tensor.

use crate::error::{Error, Result};
use crate::safetensors::{SafetensorsFile, TensorInfo};
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::path::{Component, Path, PathBuf};

/// Index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The single file of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";

/// Tensors of a checkpoint, possibly spread over several files.
pub struct Checkpoint {
    files: Vec<SafetensorsFile>,
    /// Tensor name → index into `files`.
    location: HashMap<String, usize>,
}

impl Checkpoint {
    /// Finds and opens the safetensors files of the checkpoint in `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join(INDEX_FILE);
        let (paths, weight_map) = if index_path.is_file() {
            let weight_map = read_index(&index_path)?;
            let names: BTreeSet<&str> = weight_map.values().map(String::as_str).collect();
            let paths = names.into_iter().map(|n| dir.join(n)).collect();
            (paths, Some(weight_map))
        } else if dir.join(SINGLE_FILE).is_file() {
            (vec![dir.join(SINGLE_FILE)], None)
        } else {
            (find_safetensors(dir)?, None)
        };
        let files = paths
            .iter()
            .map(SafetensorsFile::open)
            .collect::<Result<Vec<_>>>()?;

        let mut location = HashMap::new();
        for (i, file) in files.iter().enumerate() {
            for name in file.names() {
                if let Some(j) = location.insert(name.to_string(), i) {
                    return Err(Error::MalformedSafetensors {
                        path: file.path().to_path_buf(),
                        reason: format!("tensor `{name}` is also in {}", files[j].path().display()),
                    });
                }
            }
        }
        if let Some(weight_map) = weight_map {
            for (name, file_name) in &weight_map {
                let path = dir.join(file_name);
                let found = location.get(name).map(|&i| files[i].path());
                if found != Some(path.as_path()) {
                    return Err(Error::MalformedSafetensors {
                        path,
                        reason: format!("{INDEX_FILE} places tensor `{name}` here but it is not"),
                    });
                }
            }
        }
        Ok(Self { files, location })
    }

    /// The files, in the order they were opened.
    pub fn files(&self) -> &[SafetensorsFile] {
        &self.files
    }

    /// Every tensor name.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.location.keys().map(String::as_str)
    }

    /// The header entry of a tensor, if the checkpoint has it.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.file_of(name).and_then(|f| f.tensor(name))
    }

    /// Converts a tensor to f32 after checking that its shape is `shape` (slowest-varying
    /// first: `[rows, cols]` for a matrix, `[len]` for a vector).
    pub fn load_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let file = self
            .file_of(name)
            .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
        let info = file
            .tensor(name)
            .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
        if info.shape != shape {
            let dims = |s: &[usize]| s.iter().map(|&d| d as u64).collect();
            return Err(Error::ShapeMismatch {
                name: name.to_string(),
                expected: dims(shape),
                found: dims(&info.shape),
            });
        }
        file.to_f32(name)
    }

    fn file_of(&self, name: &str) -> Option<&SafetensorsFile> {
        self.location.get(name).map(|&i| &self.files[i])
    }
}

/// The `weight_map` of an index file: tensor name → file name (a plain name in the same
/// directory).
fn read_index(path: &Path) -> Result<HashMap<String, String>> {
    let json = read_json(path)?;
    let bad = |reason: String| Error::MalformedSafetensors {
        path: path.to_path_buf(),
        reason,
    };
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    map.iter()
        .map(|(name, file)| {
            let file = file
                .as_str()
                .ok_or_else(|| bad(format!("`{name}` maps to {file}, not a file name")))?;
            let mut parts = Path::new(file).components();
            match (parts.next(), parts.next()) {
                (Some(Component::Normal(_)), None) => Ok((name.clone(), file.to_string())),
                _ => Err(bad(format!(
                    "`{name}` maps to `{file}`, not a file in the model directory"
                ))),
            }
        })
        .collect()
}

/// Every `*.safetensors` file in `dir`, sorted; an error if there is none.
fn find_safetensors(dir: &Path) -> Result<Vec<PathBuf>> {
    let io = |source| Error::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.extension().is_some_and(|e| e == "safetensors") && path.is_file() {
            paths.push(path);
        }
    }
    if paths.is_empty() {
        return Err(Error::Io {
            path: dir.join(SINGLE_FILE),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file"),
            ),
        });
    }
    paths.sort();
    Ok(paths)
}

/// Reads and parses a JSON file, naming it in errors.
pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_slice(&text).map_err(|source| Error::Json {
        path: path.to_path_buf(),
        source,
    })
}

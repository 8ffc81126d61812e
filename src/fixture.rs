//! Reading the `.npy` fixtures written by `reference/gen_fixtures.py` (layout in `reference/README.md`).

use std::path::{Path, PathBuf};

use half::bf16;
use npyz::{Deserialize, NpyFile};

use crate::error::{Error, Result};
use crate::types::Logits;

/// Owned logits read from a fixture, f32 or bf16.
#[derive(Clone, Debug)]
pub enum OwnedLogits {
    /// 32-bit floats.
    F32(Vec<f32>),
    /// bfloat16 values.
    Bf16(Vec<bf16>),
}

impl OwnedLogits {
    /// Borrowed view.
    pub fn view(&self) -> Logits<'_> {
        match self {
            OwnedLogits::F32(v) => Logits::F32(v),
            OwnedLogits::Bf16(v) => Logits::Bf16(v),
        }
    }
}

/// One fixture case: a directory of `.npy` arrays plus `meta.json`.
#[derive(Clone, Debug)]
pub struct Fixture {
    dir: PathBuf,
    meta: serde_json::Value,
}

impl Fixture {
    /// Opens `dir` and parses its `meta.json`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let path = dir.join("meta.json");
        let text = std::fs::read_to_string(&path).map_err(|e| data_err(&path, e))?;
        let meta = serde_json::from_str(&text).map_err(|e| data_err(&path, e))?;
        Ok(Fixture { dir, meta })
    }

    /// Every case directory of a kernel under `root` (e.g. `fixtures/`, `"topk"`), sorted by name.
    pub fn cases(root: impl AsRef<Path>, kernel: &str) -> Result<Vec<Fixture>> {
        let dir = root.as_ref().join(kernel);
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(|e| data_err(&dir, e))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|p| p.join("meta.json").is_file())
            .collect();
        dirs.sort();
        dirs.into_iter().map(Fixture::open).collect()
    }

    /// The case's directory name.
    pub fn name(&self) -> String {
        self.dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    }

    /// A non-negative integer from `meta.json`.
    pub fn usize(&self, key: &str) -> Result<usize> {
        self.meta.get(key).and_then(|v| v.as_u64()).map(|v| v as usize).ok_or_else(|| Error::Data {
            path: self.dir.join("meta.json"),
            detail: format!("missing or non-integer key `{key}`"),
        })
    }

    /// A number from `meta.json`.
    pub fn f64(&self, key: &str) -> Result<f64> {
        self.meta.get(key).and_then(|v| v.as_f64()).ok_or_else(|| Error::Data {
            path: self.dir.join("meta.json"),
            detail: format!("missing or non-numeric key `{key}`"),
        })
    }

    /// A string from `meta.json`.
    pub fn str(&self, key: &str) -> Result<String> {
        self.meta.get(key).and_then(|v| v.as_str()).map(str::to_owned).ok_or_else(|| Error::Data {
            path: self.dir.join("meta.json"),
            detail: format!("missing or non-string key `{key}`"),
        })
    }

    /// A list of strings from `meta.json`.
    pub fn strings(&self, key: &str) -> Result<Vec<String>> {
        let list = self.meta.get(key).and_then(|v| v.as_array());
        let strings = list.and_then(|l| l.iter().map(|v| v.as_str().map(str::to_owned)).collect::<Option<Vec<_>>>());
        strings.ok_or_else(|| Error::Data {
            path: self.dir.join("meta.json"),
            detail: format!("missing key `{key}` or not a list of strings"),
        })
    }

    /// Reads `<name>.npy` as a flat vector, checking its dtype.
    pub fn array<T: Deserialize>(&self, name: &str) -> Result<Vec<T>> {
        read_npy(&self.dir.join(format!("{name}.npy")))
    }

    /// Reads logits stored as f32 or as bf16 bit patterns, as `meta.json`'s `dtype` says.
    pub fn logits(&self, name: &str) -> Result<OwnedLogits> {
        match self.str("dtype")?.as_str() {
            "f32" => Ok(OwnedLogits::F32(self.array(name)?)),
            "bf16" => {
                let bits: Vec<u16> = self.array(name)?;
                Ok(OwnedLogits::Bf16(bits.into_iter().map(bf16::from_bits).collect()))
            }
            other => Err(Error::Data {
                path: self.dir.join("meta.json"),
                detail: format!("unknown logits dtype `{other}` (expected f32 or bf16)"),
            }),
        }
    }
}

/// Reads a whole `.npy` file into a flat vector of `T`; a dtype mismatch is an error naming the file.
pub fn read_npy<T: Deserialize>(path: &Path) -> Result<Vec<T>> {
    let bytes = std::fs::read(path).map_err(|e| data_err(path, e))?;
    let npy = NpyFile::new(&bytes[..]).map_err(|e| data_err(path, e))?;
    npy.into_vec().map_err(|e| data_err(path, e))
}

fn data_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Data { path: path.to_path_buf(), detail: e.to_string() }
}

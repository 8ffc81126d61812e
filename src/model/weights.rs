//! Checkpoint tensors from safetensors files, memory-mapped: a single `model.safetensors` or shards listed
//! in `model.safetensors.index.json`. A missing tensor, a wrong dtype or shape, a truncated or missing file
//! is an error that names the tensor or the file. The checkpoint remembers which tensors were read, so that a
//! loader can name the ones its config left unused ([`Checkpoint::unread`]).

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use half::bf16;
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use crate::error::{Error, Result};

/// One memory-mapped shard.
struct Shard {
    path: PathBuf,
    map: Mmap,
}

/// The tensors of a checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// Tensor name to shard index.
    index: HashMap<String, usize>,
    /// The tensors read so far.
    read: Mutex<HashSet<String>>,
}

#[derive(Deserialize)]
struct IndexFile {
    weight_map: HashMap<String, String>,
}

fn data_err(path: &Path, detail: impl ToString) -> Error {
    Error::Data { path: path.to_path_buf(), detail: detail.to_string() }
}

impl Checkpoint {
    /// Opens `dir`: the shards of `model.safetensors.index.json` if present, else `model.safetensors`.
    /// Every shard's header is read and checked here, so a truncated file fails at open.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<String> = if index_path.is_file() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| data_err(&index_path, e))?;
            let index: IndexFile = serde_json::from_str(&text).map_err(|e| data_err(&index_path, e))?;
            let mut files: Vec<String> = index.weight_map.into_values().collect();
            files.sort();
            files.dedup();
            files
        } else {
            vec!["model.safetensors".to_string()]
        };
        let mut checkpoint = Checkpoint { dir, shards: vec![], index: HashMap::new(), read: Mutex::default() };
        for file in files {
            checkpoint.add_shard(&file)?;
        }
        Ok(checkpoint)
    }

    fn add_shard(&mut self, file: &str) -> Result<()> {
        let path = self.dir.join(file);
        let handle = File::open(&path).map_err(|e| data_err(&path, e))?;
        // Safety: the checkpoint is read-only input; the map lives as long as the Checkpoint.
        let map = unsafe { Mmap::map(&handle) }.map_err(|e| data_err(&path, e))?;
        let names: Vec<String> = {
            let tensors = SafeTensors::deserialize(&map)
                .map_err(|e| data_err(&path, format!("not a valid safetensors file: {e:?}")))?;
            tensors.names().into_iter().map(str::to_owned).collect()
        };
        let shard = self.shards.len();
        for name in names {
            self.index.insert(name, shard);
        }
        self.shards.push(Shard { path, map });
        Ok(())
    }

    /// Total bytes of the checkpoint's safetensors files.
    pub fn size_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.map.len() as u64).sum()
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The tensors never read (by [`Checkpoint::bf16`], [`Checkpoint::i32`] or [`Checkpoint::f32`]), sorted.
    pub fn unread(&self) -> Vec<String> {
        let read = self.read.lock().unwrap_or_else(PoisonError::into_inner);
        let mut names: Vec<String> = self.index.keys().filter(|n| !read.contains(*n)).cloned().collect();
        names.sort();
        names
    }

    /// Whether the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Raw bytes of `name`, checked to have `dtype` and `shape`.
    fn bytes(&self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<&[u8]> {
        let shard = self
            .index
            .get(name)
            .map(|&i| &self.shards[i])
            .ok_or_else(|| Error::Data { path: self.dir.clone(), detail: format!("missing tensor `{name}`") })?;
        let tensors = SafeTensors::deserialize(&shard.map).map_err(|e| data_err(&shard.path, format!("{e:?}")))?;
        let view = tensors.tensor(name).map_err(|e| data_err(&shard.path, format!("tensor `{name}`: {e:?}")))?;
        if view.dtype() != dtype {
            return Err(data_err(&shard.path, format!("tensor `{name}` is {:?}, expected {dtype:?}", view.dtype())));
        }
        if view.shape() != shape {
            return Err(data_err(
                &shard.path,
                format!("tensor `{name}` has shape {:?}, expected {shape:?}", view.shape()),
            ));
        }
        self.read.lock().unwrap_or_else(PoisonError::into_inner).insert(name.to_owned());
        Ok(view.data())
    }

    /// A bf16 tensor of the given shape, copied out.
    pub fn bf16(&self, name: &str, shape: &[usize]) -> Result<Vec<bf16>> {
        let bytes = self.bytes(name, Dtype::BF16, shape)?;
        Ok(bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect())
    }

    /// An i32 tensor of the given shape (INT4 `weight_packed`, `weight_shape`), copied out.
    pub fn i32(&self, name: &str, shape: &[usize]) -> Result<Vec<i32>> {
        let bytes = self.bytes(name, Dtype::I32, shape)?;
        Ok(bytes.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }

    /// An f32 tensor of the given shape (e.g. the router's correction bias), copied out.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let bytes = self.bytes(name, Dtype::F32, shape)?;
        Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }
}

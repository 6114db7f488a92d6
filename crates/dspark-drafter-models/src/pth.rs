//! PyTorch `torch.save` zip archives (`pytorch_model.bin`): the state dict's names, dtypes and
//! shapes come from `data.pkl` (parsed by candle's pickle reader), the bytes from `data/<key>`.
//! Written here rather than through `candle_core::pickle::read_all` because that one skips
//! tensors it cannot type (SafeAILab's `t2d` is a `BoolStorage`) with only a line on stderr, and
//! a strict load must see every tensor.

use crate::{NetworkError, Result};
use candle_core::pickle::{Object, Stack};
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// Every tensor of the archive, by state-dict name. Booleans become `U8` (0/1).
pub fn read(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    let bad = |e: String| NetworkError::Checkpoint(format!("{}: {e}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file))
        .map_err(|e| bad(format!("not a zip archive: {e}")))?;
    let pkl: Vec<String> =
        zip.file_names().filter(|f| f.ends_with("/data.pkl") || *f == "data.pkl").map(String::from).collect();
    let [pkl] = pkl.as_slice() else {
        return Err(bad(format!(
            "expected one data.pkl in the archive, found {}; is this a torch.save state dict?",
            pkl.len()
        )));
    };
    let prefix = pkl.strip_suffix("data.pkl").unwrap_or_default().to_string();
    let mut stack = Stack::empty();
    {
        let entry = zip.by_name(pkl).map_err(|e| bad(e.to_string()))?;
        stack.read_loop(&mut std::io::BufReader::new(entry)).map_err(|e| bad(format!("data.pkl: {e}")))?;
    }
    let obj = stack.finalize().map_err(|e| bad(format!("data.pkl: {e}")))?;
    let Object::Dict(entries) = obj else {
        return Err(bad("data.pkl does not hold a state dict (a mapping of names to tensors)".into()));
    };
    let mut out = BTreeMap::new();
    for (name, value) in entries {
        let Object::Unicode(name) = name else {
            return Err(bad(format!("a state-dict key is not a string: {name:?}")));
        };
        let info = tensor_info(value).map_err(|e| bad(format!("tensor `{name}`: {e}")))?;
        let mut bytes = Vec::new();
        zip.by_name(&format!("{prefix}data/{}", info.key))
            .map_err(|e| bad(format!("tensor `{name}`: storage {}: {e}", info.key)))?
            .read_to_end(&mut bytes)
            .map_err(|e| bad(format!("tensor `{name}`: {e}")))?;
        let t = info.build(&bytes).map_err(|e| bad(format!("tensor `{name}`: {e}")))?;
        out.insert(name, t);
    }
    Ok(out)
}

struct Info {
    key: String,
    dtype: DType,
    offset: usize,
    size: Vec<usize>,
    stride: Vec<usize>,
}

impl Info {
    /// The tensor's elements from its storage bytes; only row-major contiguous views, which is
    /// what `torch.save` writes for a state dict.
    fn build(&self, storage: &[u8]) -> std::result::Result<Tensor, String> {
        let n: usize = self.size.iter().product();
        let mut want = 1;
        for (d, s) in self.size.iter().zip(&self.stride).rev() {
            if *d > 1 && *s != want {
                return Err(format!("is a strided view (size {:?}, stride {:?})", self.size, self.stride));
            }
            want *= d;
        }
        let es = self.dtype.size_in_bytes();
        let (start, end) = (self.offset * es, (self.offset + n) * es);
        let data = storage.get(start..end).ok_or("its storage is shorter than its shape")?;
        Tensor::from_raw_buffer(data, self.dtype, &self.size, &Device::Cpu).map_err(|e| e.to_string())
    }
}

/// `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, …)`, possibly wrapped in
/// `_rebuild_parameter`.
fn tensor_info(value: Object) -> std::result::Result<Info, String> {
    let (callable, args) = value.reduce().map_err(|o| format!("is not a tensor ({o:?})"))?;
    let (callable, args) = match &callable {
        Object::Class { module_name, class_name }
            if module_name == "torch._utils" && class_name == "_rebuild_parameter" =>
        {
            let mut a = args.tuple().map_err(|_| "malformed _rebuild_parameter")?;
            if a.is_empty() {
                return Err("malformed _rebuild_parameter".into());
            }
            a.remove(0).reduce().map_err(|_| "malformed _rebuild_parameter")?
        }
        _ => (callable, args),
    };
    match &callable {
        Object::Class { module_name, class_name }
            if module_name == "torch._utils" && class_name == "_rebuild_tensor_v2" => {}
        other => return Err(format!("is built by {other:?}, not torch._utils._rebuild_tensor_v2")),
    }
    let mut a = args.tuple().map_err(|_| "malformed _rebuild_tensor_v2 arguments")?;
    if a.len() < 4 {
        return Err("malformed _rebuild_tensor_v2 arguments".into());
    }
    let ints = |o: Object| -> std::result::Result<Vec<usize>, String> {
        o.tuple()
            .map_err(|_| "size/stride is not a tuple".to_string())?
            .into_iter()
            .map(|x| {
                x.int_or_long()
                    .map(|v| v as usize)
                    .map_err(|_| "size/stride entry is not an integer".to_string())
            })
            .collect()
    };
    let stride = ints(a.remove(3))?;
    let size = ints(a.remove(2))?;
    let offset = a.remove(1).int_or_long().map_err(|_| "offset is not an integer")? as usize;
    let storage = a.remove(0).persistent_load().map_err(|_| "storage is not a persistent id")?;
    let mut st = storage.tuple().map_err(|_| "storage id is not a tuple")?;
    if st.len() < 3 {
        return Err("malformed storage id".into());
    }
    let key = st.remove(2).unicode().map_err(|_| "storage key is not a string")?;
    let (_, class) = st.remove(1).class().map_err(|_| "storage type is not a class")?;
    let dtype = match class.as_str() {
        "FloatStorage" => DType::F32,
        "DoubleStorage" => DType::F64,
        "HalfStorage" => DType::F16,
        "BFloat16Storage" => DType::BF16,
        "LongStorage" => DType::I64,
        "ByteStorage" | "BoolStorage" => DType::U8,
        other => return Err(format!("has storage type {other}, which dspark does not read")),
    };
    if size.len() != stride.len() {
        return Err("size and stride differ in rank".into());
    }
    Ok(Info { key, dtype, offset, size, stride })
}

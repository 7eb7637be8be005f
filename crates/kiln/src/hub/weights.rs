//! Moving parameters between a Burn module and safetensors files, by Hugging Face parameter path.
//!
//! A parameter's path is the chain of struct field names that leads to it (`bert.encoder.layer.3.
//! attention.self.query.weight`); a trailing `_` on a field name escapes a Rust keyword and is dropped.
//! Every tensor is stored in PyTorch's own layout, so loading and saving never transpose.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, Shape, Tensor, TensorMetadata, TensorPrimitive};
use safetensors::{Dtype, SafeTensors};

use crate::error::{KilnError, Result};
use crate::ops::KilnBackend;

/// A named, shaped f32 tensor on the host.
#[derive(Debug, Clone)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Tracks the current parameter path while walking a module.
#[derive(Default)]
pub(crate) struct PathTracker {
    parts: Vec<String>,
    containers: Vec<String>,
}

impl PathTracker {
    /// An enum's variant adds nothing to the path: a model that is one of several architectures
    /// (`SequenceClassifier::Roberta(..)`) has that architecture's own parameter names.
    pub(crate) fn enter(&mut self, name: &str, container: &str) {
        let part = if container.starts_with("Enum:") {
            ""
        } else {
            name.strip_suffix('_').unwrap_or(name)
        };
        self.parts.push(part.to_string());
        self.containers.push(container.to_string());
    }
    pub(crate) fn exit(&mut self) {
        self.parts.pop();
        self.containers.pop();
    }
    pub(crate) fn path(&self) -> String {
        let parts: Vec<&str> = self
            .parts
            .iter()
            .map(String::as_str)
            .filter(|p| !p.is_empty())
            .collect();
        parts.join(".")
    }
    /// The struct type that owns the current parameter, e.g. `LayerNorm`.
    pub(crate) fn owner(&self) -> &str {
        self.containers
            .last()
            .map(|c| c.strip_prefix("Struct:").unwrap_or(c))
            .unwrap_or("")
    }
}

/// One float parameter as seen by [`for_each_param`].
pub struct ParamInfo<'a> {
    /// Hugging Face path, e.g. `classifier.weight`.
    pub path: &'a str,
    /// Name of the struct that owns the parameter (`Linear`, `LayerNorm`, `Embedding`, ...).
    pub owner: &'a str,
}

struct Visit<'f, F> {
    tracker: PathTracker,
    f: &'f mut F,
}

/// A float parameter handed to [`for_each_param`]'s callback: its value, flattened to 1-D.
pub type FlatParam<B> = Tensor<B, 1>;

impl<B: Backend, F: FnMut(&ParamInfo, burn::module::ParamId, FlatParam<B>)> ModuleVisitor<B>
    for Visit<'_, F>
{
    fn enter_module(&mut self, name: &str, container: &str) {
        self.tracker.enter(name, container);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.tracker.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let path = self.tracker.path();
        let info = ParamInfo {
            path: &path,
            owner: self.tracker.owner(),
        };
        let value = param.val();
        let n = value.shape().num_elements();
        (self.f)(&info, param.id, value.reshape([n]));
    }
}

/// Calls `f` for every float parameter of `module`, in declaration order.
pub fn for_each_param<B: Backend, M: Module<B>>(
    module: &M,
    mut f: impl FnMut(&ParamInfo, burn::module::ParamId, FlatParam<B>),
) {
    let mut v = Visit {
        tracker: PathTracker::default(),
        f: &mut f,
    };
    module.visit(&mut v);
}

struct Map<'f, F> {
    tracker: PathTracker,
    f: &'f mut F,
}

impl<B: Backend, F> ModuleMapper<B> for Map<'_, F>
where
    F: FnMut(&ParamInfo, FloatTensor<B>) -> FloatTensor<B>,
{
    fn enter_module(&mut self, name: &str, container: &str) {
        self.tracker.enter(name, container);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.tracker.exit();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let path = self.tracker.path();
        let info = ParamInfo {
            path: &path,
            owner: self.tracker.owner(),
        };
        let (id, value, mapper) = param.consume();
        let require_grad = value.is_require_grad();
        // The value moves through (no clone, no reshape), so a kernel may update its buffer in place.
        let new = (self.f)(&info, value.detach().into_primitive().tensor());
        let new = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(new)).detach();
        let value = if require_grad {
            new.require_grad()
        } else {
            new
        };
        Param::from_mapped_value(id, value, mapper)
    }
}

/// Rebuilds `module` with each float parameter replaced by `f(info, value)`; `value` is the backend
/// tensor in the parameter's own shape, and `f` must return one of the same shape (return the value
/// itself to keep it).
pub fn map_params<B: Backend, M: Module<B>>(
    module: M,
    mut f: impl FnMut(&ParamInfo, FloatTensor<B>) -> FloatTensor<B>,
) -> M {
    let mut m = Map {
        tracker: PathTracker::default(),
        f: &mut f,
    };
    module.map(&mut m)
}

/// Integer and boolean tensors are buffers (`embeddings.position_ids`), never parameters.
fn is_buffer_dtype(d: Dtype) -> bool {
    matches!(
        d,
        Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::I16
            | Dtype::U16
            | Dtype::I32
            | Dtype::U32
            | Dtype::I64
            | Dtype::U64
    )
}

/// Reads every tensor of a safetensors file as f32 (f32, f16, bf16 and f64 are converted; integer
/// buffers such as `embeddings.position_ids` are skipped: they are not parameters). A float type
/// kiln cannot read (FP8, ...) is an error, never a silently re-initialised weight.
pub fn read_safetensors(path: &Path) -> Result<BTreeMap<String, HostTensor>> {
    read_safetensors_with(path, &mut |_, t| t)
}

/// [`read_safetensors`], each tensor handed to `keep` as soon as it is converted (to cut it to a
/// tensor-parallel shard before the next is made: the whole model is never held as f32).
pub fn read_safetensors_with(
    path: &Path,
    keep: &mut dyn FnMut(&str, HostTensor) -> HostTensor,
) -> Result<BTreeMap<String, HostTensor>> {
    let bytes = crate::hub::files::read_regular(path, "safetensors file")?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
        KilnError::Weights(format!("{}: not a safetensors file: {e}", path.display()))
    })?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let raw = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => raw
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => raw
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => raw
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F64 => raw
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)
                .collect(),
            d if is_buffer_dtype(d) => continue,
            d => {
                return Err(KilnError::Weights(format!(
                "{}: tensor {name} is stored as {d:?}; kiln reads F32, F16, BF16 and F64 weights",
                path.display()
            )))
            }
        };
        let t = HostTensor {
            shape: view.shape().to_vec(),
            data,
        };
        out.insert(name.clone(), keep(&name, t));
    }
    Ok(out)
}

/// For an error about `missing` parameters: those the file does hold, under a dtype that is not a
/// float (`" (stored as I64: a, b)"`), or an empty string.
pub fn stored_as_other_dtype(path: &Path, missing: &[&String]) -> String {
    let Ok(bytes) = crate::hub::files::read_regular(path, "safetensors file") else {
        return String::new();
    };
    let Ok((_, meta)) = SafeTensors::read_metadata(&bytes) else {
        return String::new();
    };
    let found: Vec<String> = missing
        .iter()
        .filter_map(|m| {
            let info = meta.info(m)?;
            Some(format!("{m} as {:?}", info.dtype))
        })
        .collect();
    if found.is_empty() {
        String::new()
    } else {
        format!(" (stored with a non-float dtype: {})", found.join(", "))
    }
}

/// How tensors are stored in a written safetensors file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreDtype {
    F32,
    /// Rounded to nearest even, as PyTorch's `.to(torch.bfloat16)`.
    BF16,
}

/// Writes named f32 tensors as safetensors (metadata `format: pt`, which transformers requires),
/// atomically: a temporary file in the same folder, then a rename.
pub fn write_safetensors(path: &Path, tensors: &BTreeMap<String, HostTensor>) -> Result<()> {
    write_safetensors_as(path, tensors, StoreDtype::F32)
}

/// [`write_safetensors`] storing every tensor as `dtype`.
pub fn write_safetensors_as(
    path: &Path,
    tensors: &BTreeMap<String, HostTensor>,
    dtype: StoreDtype,
) -> Result<()> {
    crate::hub::atomic_write(path, &safetensors_bytes(tensors, dtype)?)
}

/// The bytes of a safetensors file holding `tensors` as `dtype` (metadata `format: pt`).
pub fn safetensors_bytes(
    tensors: &BTreeMap<String, HostTensor>,
    dtype: StoreDtype,
) -> Result<Vec<u8>> {
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(k, t)| {
            let b = match dtype {
                StoreDtype::F32 => t.data.iter().flat_map(|x| x.to_le_bytes()).collect(),
                StoreDtype::BF16 => t
                    .data
                    .iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect(),
            };
            (k.clone(), b, t.shape.clone())
        })
        .collect();
    let st_dtype = match dtype {
        StoreDtype::F32 => Dtype::F32,
        StoreDtype::BF16 => Dtype::BF16,
    };
    let views = bytes
        .iter()
        .map(|(k, b, s)| {
            safetensors::tensor::TensorView::new(st_dtype, s.clone(), b)
                .map(|v| (k.clone(), v))
                .map_err(|e| KilnError::Weights(format!("tensor {k}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, Some(meta)).map_err(|e| KilnError::Weights(e.to_string()))
}

/// Every float parameter's shape, keyed by Hugging Face path (no data is read).
pub fn module_shapes<B: Backend, M: Module<B>>(module: &M) -> BTreeMap<String, Vec<usize>> {
    struct Shapes(PathTracker, BTreeMap<String, Vec<usize>>);
    impl<B: Backend> ModuleVisitor<B> for Shapes {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.0.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.exit();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            self.1.insert(self.0.path(), p.val().dims().to_vec());
        }
    }
    let mut v = Shapes(PathTracker::default(), BTreeMap::new());
    module.visit(&mut v);
    v.1
}

/// Every float parameter of `module` as host tensors keyed by Hugging Face path.
pub fn module_tensors<B: Backend, M: Module<B>>(module: &M) -> BTreeMap<String, HostTensor> {
    let mut out = BTreeMap::new();
    let mut shapes = Vec::new();
    // Shapes are lost by flattening; collect them with a second small visitor.
    struct Shapes<'a>(&'a mut Vec<Vec<usize>>);
    impl<B: Backend> ModuleVisitor<B> for Shapes<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            self.0.push(p.val().dims().to_vec());
        }
    }
    module.visit(&mut Shapes(&mut shapes));
    let mut i = 0;
    for_each_param(module, |info, _, flat| {
        let data = flat
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("f32 data");
        out.insert(
            info.path.to_string(),
            HostTensor {
                shape: shapes[i].clone(),
                data,
            },
        );
        i += 1;
    });
    out
}

/// What [`load_into`] did.
#[derive(Debug, Default, Clone)]
pub struct LoadReport {
    pub loaded: Vec<String>,
    /// Parameters the files did not have (they keep their fresh initialisation).
    pub missing: Vec<String>,
    /// Tensors in the files that the model has no parameter for.
    pub unexpected: Vec<String>,
}

/// Loads `tensors` into `module` by path, moving each tensor's data into the model (no copy: a
/// model's weights are never held twice on the host). `strip_prefix` is the base-model prefix
/// (`bert`) that a checkpoint of the bare encoder lacks, the way transformers'
/// `base_model_prefix` handling works.
pub fn load_into<B: KilnBackend, M: Module<B>>(
    module: M,
    mut tensors: BTreeMap<String, HostTensor>,
    base_prefix: Option<&str>,
    device: &B::Device,
) -> Result<(M, LoadReport)> {
    let mut report = LoadReport::default();
    let mut error = None;
    let module = map_params(module, |info, current: FloatTensor<B>| {
        let shape = current.shape().dims;
        let mut candidates = vec![info.path.to_string()];
        if let Some(prefix) = base_prefix {
            if let Some(rest) = info.path.strip_prefix(&format!("{prefix}.")) {
                candidates.push(rest.to_string());
            }
        }
        let Some((key, t)) = candidates
            .iter()
            .find_map(|c| tensors.remove(c).map(|t| (c.clone(), t)))
        else {
            report.missing.push(info.path.to_string());
            return current;
        };
        if t.shape != shape {
            error.get_or_insert(KilnError::Weights(format!(
                "tensor {key}: checkpoint shape {:?} does not match the model's {:?} (check config.json)",
                t.shape, shape
            )));
            return current;
        }
        report.loaded.push(info.path.to_string());
        B::kiln_from_host(t.data, Shape::from(t.shape), device)
    });
    if let Some(e) = error {
        return Err(e);
    }
    report.unexpected = tensors.into_keys().collect();
    Ok((module, report))
}

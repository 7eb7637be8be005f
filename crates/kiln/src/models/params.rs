//! Walking a model's parameters by Hugging Face path: visiting or replacing each one, their
//! shapes and host copies, and loading named host tensors into a module (what is missing,
//! unexpected or of another shape is reported, never silently skipped).
//!
//! A parameter's path is the chain of struct field names that leads to it (`bert.encoder.layer.3.
//! attention.self.query.weight`); a trailing `_` on a field name escapes a Rust keyword and is
//! dropped; an enum variant adds no part.

use std::collections::BTreeMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, Shape, Tensor, TensorMetadata, TensorPrimitive};

use crate::error::{KilnError, Result};
use crate::formats::safetensors::HostTensor;
pub use crate::formats::safetensors::{keep_all, Keep};
use crate::ops::KilnBackend;

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

/// `module` with each float parameter that `keep` refuses (asked with its path under `prefix`)
/// let go: an empty tensor of the same rank, its first dimension 0, takes its place. A pipeline
/// stage keeps the other stages' parameters this way: the model's structure (and every walk over
/// it) stays the same on every stage, and their memory is never held.
pub fn empty_where<B: Backend, M: Module<B>>(module: M, prefix: &str, keep: Keep) -> M {
    map_params(module, |info, value: FloatTensor<B>| {
        let kept = match prefix {
            "" => keep(info.path),
            _ => keep(&format!("{prefix}.{}", info.path)),
        };
        if kept {
            return value;
        }
        let mut empty = value.shape().dims;
        empty[0] = 0;
        let device = B::float_device(&value);
        let zeros = Tensor::<B, 1>::zeros([0], &device)
            .into_primitive()
            .tensor();
        B::float_reshape(zeros, Shape::from(empty))
    })
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

/// The paths of the float parameters `module` holds in bf16 (frozen LoRA bases under
/// `--lora-base-dtype bf16`).
pub fn module_bf16_params<B: Backend, M: Module<B>>(
    module: &M,
) -> std::collections::BTreeSet<String> {
    struct Bf16(PathTracker, std::collections::BTreeSet<String>);
    impl<B: Backend> ModuleVisitor<B> for Bf16 {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.0.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.exit();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            let dtype = p.val().dtype();
            if matches!(dtype, burn::tensor::DType::U16 | burn::tensor::DType::BF16) {
                self.1.insert(self.0.path());
            }
        }
    }
    let mut v = Bf16(PathTracker::default(), Default::default());
    module.visit(&mut v);
    v.1
}

/// Every float parameter of `module` as host tensors keyed by Hugging Face path.
pub fn module_tensors<B: crate::ops::KilnBackend, M: Module<B>>(
    module: &M,
) -> BTreeMap<String, HostTensor> {
    module_tensors_where(module, |_| true)
}

/// The float parameters of `module` whose path `keep` accepts, as host tensors (the others are
/// never copied).
pub fn module_tensors_where<B: crate::ops::KilnBackend, M: Module<B>>(
    module: &M,
    keep: impl Fn(&str) -> bool,
) -> BTreeMap<String, HostTensor> {
    struct Copy<F> {
        tracker: PathTracker,
        keep: F,
        out: BTreeMap<String, HostTensor>,
    }
    impl<B: crate::ops::KilnBackend, F: Fn(&str) -> bool> ModuleVisitor<B> for Copy<F> {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.tracker.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.tracker.exit();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            let path = self.tracker.path();
            if !(self.keep)(&path) {
                return;
            }
            // A frozen weight held in bf16 is copied as its f32 values.
            let value = crate::ops::from_bf16_store(p.val());
            let shape = value.dims().to_vec();
            let data = value
                .into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("f32 data");
            self.out.insert(path, HostTensor { shape, data });
        }
    }
    let mut copy = Copy {
        tracker: PathTracker::default(),
        keep,
        out: BTreeMap::new(),
    };
    module.visit(&mut copy);
    copy.out
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

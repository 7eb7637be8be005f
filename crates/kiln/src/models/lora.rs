//! LoRA adapters in PEFT's format: which Linear layers get one (`target_modules`, `all-linear`),
//! their initialisation, the frozen base, and the names and files PEFT reads and writes
//! (`adapter_config.json`, `adapter_model.safetensors`), so that `PeftModel.from_pretrained` loads
//! what kiln trained and kiln continues training what PEFT saved.
//!
//! Inside kiln an adapter is two parameters of the [`Linear`] it adapts, `<layer>.lora_a.weight`
//! `[r, in]` and `<layer>.lora_b.weight` `[out, r]`; PEFT names them
//! `base_model.model.<layer>.lora_A.weight` / `lora_B.weight` in its file. Every other parameter
//! is frozen (no gradient, so no weight-gradient product and no optimizer state), except those of
//! `modules_to_save`, which train whole and are saved as `base_model.model.<module>.<param>`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use burn::module::{Ignored, Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::contract::ParamSplit;
use crate::error::{KilnError, Result};
use crate::formats::safetensors::HostTensor;
use crate::models::layers::{Linear, LoraFactor, LoraScale};
use crate::models::params::PathTracker;
use crate::ops::KilnBackend;

/// The adapter files' names in a PEFT folder.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// The `task_type`s of the models kiln adapts (PEFT's `TaskType` names; `null` is a bare model).
const KNOWN_TASK_TYPES: [&str; 3] = ["CAUSAL_LM", "SEQ_CLS", "FEATURE_EXTRACTION"];

/// The largest LoRA rank kiln accepts (adapters use 4–256).
const MAX_RANK: usize = 65_536;

/// The prefix PEFT puts before the base model's own parameter paths.
const PEFT_PREFIX: &str = "base_model.model.";

/// Which Linear layers get an adapter (PEFT's `target_modules`).
#[derive(Debug, Clone, PartialEq)]
pub enum TargetModules {
    /// The model type's default, as PEFT's table of defaults has it (Llama's `q_proj, v_proj`).
    ModelDefault,
    /// Every Linear but the output layer (PEFT's `"all-linear"`).
    AllLinear,
    /// Layers whose path is one of these names or ends with `.<name>`.
    Names(Vec<String>),
}

impl TargetModules {
    /// `--lora-target-modules`: `all-linear`, or names separated by commas.
    pub fn parse(s: &str) -> Self {
        if s.trim() == "all-linear" {
            return Self::AllLinear;
        }
        Self::Names(
            s.split(',')
                .map(|n| n.trim().to_string())
                .filter(|n| !n.is_empty())
                .collect(),
        )
    }

    fn matches(&self, path: &str, output_layer: bool, default: &[&str]) -> bool {
        match self {
            Self::ModelDefault => default.iter().any(|n| suffix_match(path, n)),
            Self::AllLinear => !output_layer,
            Self::Names(names) => names.iter().any(|n| suffix_match(path, n)),
        }
    }
}

impl std::fmt::Display for TargetModules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ModelDefault => f.write_str("(the model's default)"),
            Self::AllLinear => f.write_str("all-linear"),
            Self::Names(n) => f.write_str(&n.join(",")),
        }
    }
}

/// `path` is `name` or ends with `.name` (PEFT's rule for a list of module names).
fn suffix_match(path: &str, name: &str) -> bool {
    path == name || path.ends_with(&format!(".{name}"))
}

/// A LoRA adapter's settings, under PEFT's `LoraConfig` names.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub r: usize,
    pub alpha: f64,
    pub dropout: f64,
    pub target_modules: TargetModules,
    /// Scale by `alpha / √r` instead of `alpha / r` (rsLoRA).
    pub use_rslora: bool,
    /// Modules trained whole beside the adapters (a classification head).
    pub modules_to_save: Vec<String>,
}

impl LoraConfig {
    /// What multiplies `B A x`.
    pub fn scaling(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    /// Reads a PEFT folder's `adapter_config.json` (a LoRA one).
    pub fn from_adapter_dir(dir: &Path) -> Result<Self> {
        let path = dir.join(ADAPTER_CONFIG);
        let bytes = crate::io::files::read_regular(&path, "adapter config")?;
        let v: Value = crate::io::parse_json(&path, &bytes)?;
        let bad = |field: &str, why: &str| {
            KilnError::Config(format!("{}: field `{field}` {why}", path.display()))
        };
        match v["peft_type"].as_str() {
            Some("LORA") => {}
            other => {
                return Err(bad(
                    "peft_type",
                    &format!("is {other:?}; kiln reads LoRA adapters (\"LORA\") only"),
                ))
            }
        }
        for (field, off) in [("use_dora", false), ("fan_in_fan_out", false)] {
            if v[field].as_bool().unwrap_or(off) != off {
                return Err(bad(field, "is true, which kiln does not support"));
            }
        }
        if v["bias"].as_str().unwrap_or("none") != "none" {
            return Err(bad("bias", "is not \"none\", which kiln does not support"));
        }
        for field in ["rank_pattern", "alpha_pattern"] {
            if v[field].as_object().is_some_and(|m| !m.is_empty()) {
                return Err(bad(field, "is not empty, which kiln does not support"));
            }
        }
        // Fields that change which layers are adapted, or how, beyond what kiln builds: PEFT
        // would build another model from them, so they are refused rather than ignored (and
        // dropped when training writes the adapter back).
        for (field, what) in [
            ("layers_to_transform", "adapts only some layers' modules"),
            (
                "layers_pattern",
                "names the layers that layers_to_transform counts",
            ),
            ("layer_replication", "repeats layers of the base"),
            ("exclude_modules", "leaves modules out of target_modules"),
            ("target_parameters", "adapts parameters rather than modules"),
            ("trainable_token_indices", "trains some embedding rows"),
        ] {
            let set = match &v[field] {
                Value::Null => false,
                Value::Array(a) => !a.is_empty(),
                Value::Object(m) => !m.is_empty(),
                Value::String(s) => !s.is_empty(),
                _ => true,
            };
            if set {
                return Err(bad(
                    field,
                    &format!(
                        "is {}, which {what}; kiln does not implement it and would build a \
                         different model than PEFT does",
                        v[field]
                    ),
                ));
            }
        }
        for field in ["lora_bias", "use_qalora"] {
            if v[field].as_bool().unwrap_or(false) {
                return Err(bad(field, "is true, which kiln does not support"));
            }
        }
        match &v["task_type"] {
            Value::Null => {}
            Value::String(t) if KNOWN_TASK_TYPES.contains(&t.as_str()) => {}
            other => {
                return Err(bad(
                    "task_type",
                    &format!(
                        "is {other}; kiln reads adapters of {}",
                        KNOWN_TASK_TYPES.join(", ")
                    ),
                ))
            }
        }
        let dropout = match &v["lora_dropout"] {
            Value::Null => 0.0,
            d => d
                .as_f64()
                .filter(|d| (0.0..1.0).contains(d))
                .ok_or_else(|| {
                    bad(
                        "lora_dropout",
                        &format!("is {d}; it must be at least 0 and below 1"),
                    )
                })?,
        };
        let r = v["r"]
            .as_u64()
            .filter(|&r| r > 0)
            .ok_or_else(|| bad("r", "must be a positive integer"))? as usize;
        let target_modules = match &v["target_modules"] {
            Value::String(s) if s == "all-linear" => TargetModules::AllLinear,
            Value::String(s) => {
                return Err(bad(
                    "target_modules",
                    &format!("is the regular expression {s:?}; kiln reads a list of names"),
                ))
            }
            Value::Array(a) => TargetModules::Names(
                a.iter()
                    .map(|n| n.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad("target_modules", "must be a list of strings"))?,
            ),
            _ => return Err(bad("target_modules", "must be a list of module names")),
        };
        let modules_to_save = match &v["modules_to_save"] {
            Value::Null => Vec::new(),
            Value::Array(a) => a
                .iter()
                .map(|n| n.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("modules_to_save", "must be a list of strings"))?,
            _ => return Err(bad("modules_to_save", "must be a list of module names")),
        };
        Ok(Self {
            r,
            alpha: v["lora_alpha"]
                .as_f64()
                .ok_or_else(|| bad("lora_alpha", "must be a number"))?,
            dropout,
            target_modules,
            use_rslora: v["use_rslora"].as_bool().unwrap_or(false),
            modules_to_save,
        })
    }
}

/// A model LoRA can adapt: its Linear layers by Hugging Face module path.
pub trait LoraTarget<B: Backend> {
    /// Every Linear layer with its module path (`model.layers.0.self_attn.q_proj`).
    fn linears_mut(&mut self) -> Vec<(String, &mut Linear<B>)>;
    /// The module paths `all-linear` leaves out: the output layer (PEFT skips the LM head and a
    /// classifier, which `modules_to_save` trains whole instead).
    fn output_layers(&self) -> Vec<String>;
    /// The layers LoRA adapts when no target modules are given (PEFT's per-model defaults).
    fn default_target_modules(&self) -> &'static [&'static str];
    /// Modules that share their parameter with another (a tied embedding and output head),
    /// which `modules_to_save` cannot hold as PEFT loads them.
    fn tied_modules(&self) -> Vec<String> {
        Vec::new()
    }
    /// PEFT's `task_type` for this model (`CAUSAL_LM`, `SEQ_CLS`).
    fn peft_task_type(&self) -> &'static str;
    /// Modules PEFT trains whole for this task whatever the config says (a sequence
    /// classifier's head: PEFT adds `classifier` and `score` to `modules_to_save`).
    fn task_modules_to_save(&self) -> Vec<String> {
        Vec::new()
    }
    /// How parameter `path` is cut on this tensor-parallel rank (whole without tensor
    /// parallelism); adapter factors included ([`factor_split`]).
    fn split_of(&self, _path: &str) -> ParamSplit {
        ParamSplit::Replicated
    }
}

/// How a LoRA factor's parameter is cut, from how its layer's weight is (`base`), as Megatron's
/// and NxD's LoRA layers cut it: beside a weight cut by output rows (column-parallel), `B`
/// `[out, r]` is cut by the same rows and `A` is whole; beside a weight cut by input columns
/// (row-parallel), `A` `[r, in]` is cut by the same columns and `B` is whole. `None` for a path
/// that is not a factor.
pub fn factor_split(path: &str, base: impl Fn(&str) -> ParamSplit) -> Option<ParamSplit> {
    let (layer, axis) = if let Some(l) = path.strip_suffix(".lora_a.weight") {
        (l, 1)
    } else {
        (path.strip_suffix(".lora_b.weight")?, 0)
    };
    Some(match base(&format!("{layer}.weight")) {
        ParamSplit::Sharded {
            axis: a,
            range,
            full,
        } if a == axis => ParamSplit::Sharded { axis, range, full },
        _ => ParamSplit::Replicated,
    })
}

/// What attaching adapters did.
#[derive(Debug, Clone, PartialEq)]
pub struct Adapter {
    pub config: LoraConfig,
    /// The adapted layers' own names (`q_proj`, `v_proj`), as PEFT writes `target_modules`.
    pub targeted: BTreeSet<String>,
    /// `modules_to_save` with the task's own added.
    pub modules_to_save: Vec<String>,
    pub task_type: &'static str,
}

impl Adapter {
    /// Whether the parameter at `path` is part of the adapter (trained and saved).
    pub fn owns(&self, path: &str) -> bool {
        is_lora_param(path) || self.saves_whole(path)
    }

    fn saves_whole(&self, path: &str) -> bool {
        let module = path.rsplit_once('.').map_or("", |(m, _)| m);
        self.modules_to_save
            .iter()
            .any(|m| suffix_match(module, m) || module_under(module, m))
    }

    /// PEFT's `adapter_config.json` for this adapter: the keys every PEFT release since 0.10
    /// reads (newer ones add keys of their own with neutral defaults; older ones refuse keys they
    /// do not know).
    pub fn config_json(&self, base_model: &str) -> String {
        let c = &self.config;
        let v = json!({
            "alpha_pattern": {},
            "base_model_name_or_path": base_model,
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "layer_replication": null,
            "layers_pattern": null,
            "layers_to_transform": null,
            "loftq_config": {},
            // PEFT types lora_alpha as an int: written as one where it is whole.
            "lora_alpha": if c.alpha.fract() == 0.0 && c.alpha.abs() < 1e15 {
                json!(c.alpha as i64)
            } else {
                json!(c.alpha)
            },
            "megatron_config": null,
            "megatron_core": "megatron.core",
            "lora_dropout": c.dropout,
            "modules_to_save": (!self.modules_to_save.is_empty()).then_some(&self.modules_to_save),
            "peft_type": "LORA",
            "r": c.r,
            "rank_pattern": {},
            "revision": null,
            "target_modules": self.targeted.iter().collect::<Vec<_>>(),
            "task_type": self.task_type,
            "use_dora": false,
            "use_rslora": c.use_rslora,
        });
        // PEFT writes the file with sorted keys.
        crate::io::to_sorted_json_pretty(&v)
    }

    /// This adapter's tensors from all of a model's, under PEFT's names.
    pub fn peft_tensors(&self, all: &BTreeMap<String, HostTensor>) -> BTreeMap<String, HostTensor> {
        all.iter()
            .filter(|(path, _)| self.owns(path))
            .map(|(path, t)| (peft_key(path), t.clone()))
            .collect()
    }
}

/// `module` lies inside a module path ending with `name` (`classifier.dense` under `classifier`).
fn module_under(module: &str, name: &str) -> bool {
    let mut prefix = String::new();
    for part in module.split('.') {
        if !prefix.is_empty() {
            prefix.push('.');
        }
        prefix.push_str(part);
        if prefix != module && suffix_match(&prefix, name) {
            return true;
        }
    }
    false
}

/// A LoRA factor's parameter path (`….lora_a.weight` or `….lora_b.weight`).
pub fn is_lora_param(path: &str) -> bool {
    path.ends_with(".lora_a.weight") || path.ends_with(".lora_b.weight")
}

/// kiln's parameter path → PEFT's key in `adapter_model.safetensors`.
pub fn peft_key(path: &str) -> String {
    let p = path
        .replace(".lora_a.weight", ".lora_A.weight")
        .replace(".lora_b.weight", ".lora_B.weight");
    format!("{PEFT_PREFIX}{p}")
}

/// PEFT's key → kiln's parameter path (`None` for a key outside `base_model.model.`). The names
/// PEFT's modules have in memory (`lora_A.default.weight`, `classifier.modules_to_save.default.
/// weight`) are read too.
pub fn internal_key(key: &str) -> Option<String> {
    let p = key.strip_prefix(PEFT_PREFIX)?;
    let p = p
        .replace(".modules_to_save.default.", ".")
        .replace(".lora_A.default.weight", ".lora_a.weight")
        .replace(".lora_B.default.weight", ".lora_b.weight")
        .replace(".lora_A.weight", ".lora_a.weight")
        .replace(".lora_B.weight", ".lora_b.weight");
    Some(p)
}

/// Attaches a fresh adapter to every targeted Linear of `model` and freezes every parameter that
/// is not part of it. `A` is drawn as PEFT draws it (Kaiming-uniform with `a = √5`, i.e.
/// U(±1/√in)) from `seed` and the layer's path, so every rank of a job draws the same values; `B`
/// is zero, so the adapted model starts equal to the base.
pub fn attach<B: KilnBackend, M: LoraTarget<B> + Module<B>>(
    model: M,
    config: &LoraConfig,
    seed: u64,
) -> Result<(M, Adapter)> {
    attach_from(model, config, seed, "--lora-target-modules")
}

/// [`attach`], naming where the configuration came from (`source`) in its errors.
fn attach_from<B: KilnBackend, M: LoraTarget<B> + Module<B>>(
    mut model: M,
    config: &LoraConfig,
    seed: u64,
    source: &str,
) -> Result<(M, Adapter)> {
    // The rank sizes every adapter's allocation; it comes from a flag or an adapter's config.
    if config.r == 0 || config.r > MAX_RANK {
        return Err(KilnError::Config(format!(
            "LoRA rank r = {}: must be between 1 and {MAX_RANK}",
            config.r
        )));
    }
    // PEFT wraps a saved module apart from the head tied to it: loaded, its head would keep the
    // original embedding while kiln trained them as one. Refused rather than saved that way.
    let tied = model.tied_modules();
    if let Some(m) = config.modules_to_save.iter().find(|m| {
        tied.iter()
            .any(|t| suffix_match(t, m) || module_under(t, m))
    }) {
        let flag = if source == "--lora-target-modules" {
            "--lora-modules-to-save".to_string()
        } else {
            source.replace("target_modules", "modules_to_save")
        };
        return Err(KilnError::Config(format!(
            "{flag} {m}: this model ties its output head to its input embedding \
             (tie_word_embeddings), and PEFT saves and loads such a module apart from the head, \
             so the trained adapter would load as another model; adapt {m} with LoRA \
             (--lora-target-modules) or use a model that does not tie them"
        )));
    }
    let output = model.output_layers();
    let default = model.default_target_modules();
    let scale = LoraScale {
        scaling: config.scaling(),
        dropout: config.dropout,
    };
    // Under tensor parallelism a row-parallel layer's `A` is cut by input columns: it is drawn
    // whole and cut, so every TP size starts from the adapter of TP = 1.
    let paths: Vec<String> = model.linears_mut().into_iter().map(|(p, _)| p).collect();
    let a_cuts: Vec<ParamSplit> = paths
        .iter()
        .map(|p| model.split_of(&format!("{p}.lora_a.weight")))
        .collect();
    let mut targeted = BTreeSet::new();
    let mut names = Vec::new();
    for ((path, layer), a_cut) in model.linears_mut().into_iter().zip(a_cuts) {
        names.push(path.clone());
        if !config
            .target_modules
            .matches(&path, output.contains(&path), default)
        {
            continue;
        }
        let [out, inp] = layer.weight.dims();
        let (full_in, cols) = match a_cut {
            ParamSplit::Sharded {
                axis: 1,
                range,
                full,
            } => (full, range),
            _ => (inp, 0..inp),
        };
        let device = layer.weight.device();
        let bound = 1.0 / (full_in as f64).sqrt();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ fnv1a(&path));
        let whole: Vec<f32> = (0..config.r * full_in)
            .map(|_| rng.random_range(-bound..bound) as f32)
            .collect();
        let a: Vec<f32> = whole
            .chunks(full_in)
            .flat_map(|row| row[cols.clone()].iter().copied())
            .collect();
        let a = Tensor::<B, 2>::from_data(TensorData::new(a, [config.r, cols.len()]), &device);
        layer.lora_a = Some(LoraFactor {
            weight: Param::from_tensor(crate::ops::owned(a)),
        });
        layer.lora_b = Some(LoraFactor {
            weight: Param::from_tensor(crate::ops::owned(Tensor::zeros([out, config.r], &device))),
        });
        layer.lora = Ignored(Some(scale));
        targeted.insert(path.rsplit('.').next().unwrap_or(&path).to_string());
    }
    if targeted.is_empty() {
        return Err(KilnError::Config(format!(
            "{source} {}: matches none of this model's Linear layers ({})",
            config.target_modules,
            layer_kinds(&names)
        )));
    }
    let mut modules_to_save = config.modules_to_save.clone();
    for m in model.task_modules_to_save() {
        if !modules_to_save.contains(&m) {
            modules_to_save.push(m);
        }
    }
    let adapter = Adapter {
        config: config.clone(),
        targeted,
        modules_to_save,
        task_type: model.peft_task_type(),
    };
    let model = freeze_base(model, &adapter);
    Ok((model, adapter))
}

/// The distinct last parts of the layers' paths, for a message (`q_proj, k_proj, …`).
fn layer_kinds(paths: &[String]) -> String {
    let mut seen = Vec::new();
    for p in paths {
        let last = p.rsplit('.').next().unwrap_or(p);
        if !seen.contains(&last) {
            seen.push(last);
        }
    }
    seen.join(", ")
}

/// FNV-1a of a path: a stable per-layer seed offset (the standard library's hasher is not
/// stable across releases).
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Every parameter the adapter does not own stops requiring a gradient.
fn freeze_base<B: Backend, M: Module<B>>(model: M, adapter: &Adapter) -> M {
    struct Freeze<'a> {
        tracker: PathTracker,
        adapter: &'a Adapter,
    }
    impl<B: Backend> ModuleMapper<B> for Freeze<'_> {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.tracker.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.tracker.exit();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let path = self.tracker.path();
            if self.adapter.owns(&path) {
                param
            } else {
                param.set_require_grad(false)
            }
        }
    }
    model.map(&mut Freeze {
        tracker: PathTracker::default(),
        adapter,
    })
}

/// The dtype a LoRA run holds its frozen base in (`--base-dtype`): f32, or bf16 at half the
/// memory, as a PEFT user loads the base with `torch_dtype=torch.bfloat16` while the adapter and
/// its optimizer state stay f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BaseDtype {
    #[default]
    F32,
    Bf16,
}

/// `model` with every frozen Linear weight and embedding table (the matrices that are the bulk
/// of a base) held in bf16, rounded to nearest as `.to(torch.bfloat16)`; norms, biases and what
/// the adapter trains stay f32. An error where the backend has no bf16 storage.
pub fn hold_base_in_bf16<B: KilnBackend, M: Module<B>>(model: M, adapter: &Adapter) -> Result<M> {
    struct ToBf16<'a> {
        tracker: PathTracker,
        adapter: &'a Adapter,
        unsupported: bool,
    }
    impl<B: KilnBackend> ModuleMapper<B> for ToBf16<'_> {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.tracker.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.tracker.exit();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let frozen_matrix = D == 2
                && matches!(self.tracker.owner(), "Linear" | "Embedding")
                && !self.adapter.owns(&self.tracker.path());
            if !frozen_matrix || self.unsupported {
                return param;
            }
            let (id, value, mapper) = param.consume();
            match crate::ops::to_bf16_store(value.clone()) {
                Some(held) => Param::from_mapped_value(id, held, mapper),
                None => {
                    self.unsupported = true;
                    Param::from_mapped_value(id, value, mapper)
                }
            }
        }
    }
    let mut to_bf16 = ToBf16 {
        tracker: PathTracker::default(),
        adapter,
        unsupported: false,
    };
    // The f32 weights replaced go back to the system (an allocator may keep freed memory).
    let model = crate::backend::releasing_freed_memory(|| model.map(&mut to_bf16));
    if to_bf16.unsupported {
        return Err(KilnError::Config(
            "--base-dtype bf16 holds the frozen base in bf16 on the CPU backend only so far: \
             drop the option (or use --device cpu)"
                .into(),
        ));
    }
    Ok(model)
}

/// PEFT's `print_trainable_parameters` line: `trainable params: … || all params: … ||
/// trainable%: …`, from every parameter's path and element count.
pub fn trainable_line<'a>(
    params: impl Iterator<Item = (&'a str, usize)>,
    adapter: &Adapter,
) -> String {
    let (mut trainable, mut all) = (0usize, 0usize);
    for (path, n) in params {
        all += n;
        if adapter.owns(path) {
            trainable += n;
        }
    }
    format!(
        "trainable params: {} || all params: {} || trainable%: {:.4}",
        thousands(trainable),
        thousands(all),
        100.0 * trainable as f64 / all.max(1) as f64
    )
}

fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A PEFT folder's tensors under kiln's paths, checked against the adapter its
/// `adapter_config.json` describes (see [`check_tensors`]): every reader of an adapter (training
/// on it, merging, resharding, resuming) goes through here.
pub fn read_adapter_tensors(dir: &Path) -> Result<BTreeMap<String, HostTensor>> {
    let config = LoraConfig::from_adapter_dir(dir)?;
    let path = dir.join(ADAPTER_WEIGHTS);
    let tensors = crate::formats::safetensors::read_safetensors(&path)?;
    let tensors = tensors
        .into_iter()
        .map(|(key, t)| match internal_key(&key) {
            Some(p) => Ok((p, t)),
            None => Err(KilnError::Config(format!(
                "{}: tensor `{key}` is not under `{PEFT_PREFIX}`, so it is not a PEFT adapter's",
                path.display()
            ))),
        })
        .collect::<Result<BTreeMap<_, _>>>()?;
    check_tensors(&config, &tensors).map_err(|why| {
        KilnError::Config(format!(
            "{}: {why} (adapter_config.json beside it says r = {}{})",
            path.display(),
            config.r,
            if config.modules_to_save.is_empty() {
                String::new()
            } else {
                format!(", modules_to_save {:?}", config.modules_to_save)
            }
        ))
    })?;
    Ok(tensors)
}

/// The adapter's tensors agree with its config as PEFT builds it: each factor pair of rank `r`
/// (`A` `[r, in]`, `B` `[out, r]`; the merge scale `alpha / r` depends on it), and each
/// `modules_to_save` entry saved (a sequence classifier's `classifier` / `score`, which PEFT lists
/// for every model, need only one of them).
fn check_tensors(
    config: &LoraConfig,
    tensors: &BTreeMap<String, HostTensor>,
) -> std::result::Result<(), String> {
    for (path, t) in tensors.iter().filter(|(p, _)| is_lora_param(p)) {
        let key = peft_key(path);
        let a = path.ends_with(".lora_a.weight");
        let rank = match (t.shape.as_slice(), a) {
            ([r, _], true) | ([_, r], false) => *r,
            (shape, _) => return Err(format!("`{key}` is {shape:?}, not a matrix")),
        };
        if rank != config.r {
            return Err(format!("`{key}` {:?} has rank {rank}", t.shape));
        }
        let layer = path
            .trim_end_matches(".lora_a.weight")
            .trim_end_matches(".lora_b.weight");
        let other = format!("{layer}.lora_{}.weight", if a { 'b' } else { 'a' });
        if !tensors.contains_key(&other) {
            return Err(format!("`{key}` has no {} beside it", peft_key(&other)));
        }
    }
    let saved = |m: &str| {
        tensors.keys().filter(|p| !is_lora_param(p)).any(|p| {
            let module = p.rsplit_once('.').map_or("", |(m, _)| m);
            suffix_match(module, m) || module_under(module, m)
        })
    };
    let heads = ["classifier", "score"];
    for m in &config.modules_to_save {
        let head_saved = heads.contains(&m.as_str()) && heads.iter().any(|h| saved(h));
        if !saved(m) && !head_saved {
            return Err(format!(
                "modules_to_save names `{m}`, but no tensor of it is saved"
            ));
        }
    }
    Ok(())
}

/// `model` with the PEFT adapter of folder `dir` attached (its `adapter_config.json` and
/// weights) and its base frozen, and the adapter; every adapter tensor must find its parameter
/// and every adapter parameter its tensor.
pub fn load_adapter<B: KilnBackend, M: LoraTarget<B> + Module<B>>(
    model: M,
    dir: &Path,
    device: &B::Device,
    keep: crate::models::params::Keep,
) -> Result<(M, Adapter)> {
    let config = LoraConfig::from_adapter_dir(dir)?;
    // An adapter of another architecture fails here, naming its file.
    let source = format!("{}: target_modules", dir.join(ADAPTER_CONFIG).display());
    let (model, adapter) = attach_from(model, &config, 0, &source)?;
    // A pipeline stage holds (and reads) the factors of its own layers only.
    let model = crate::models::params::empty_where(model, "", keep);
    // Under tensor parallelism each rank takes its cut of the whole adapter.
    let tensors = read_adapter_tensors(dir)?
        .into_iter()
        .filter(|(path, _)| keep(path))
        .map(|(path, t)| {
            let cut = crate::formats::sharded::cut_split(&t, &model.split_of(&path)).unwrap_or(t);
            (path, cut)
        })
        .collect();
    let (model, report) = crate::models::params::load_into(model, tensors, None, device)?;
    let missing: Vec<&String> = report
        .missing
        .iter()
        .filter(|p| adapter.owns(p) && keep(p))
        .collect();
    if !report.unexpected.is_empty() || !missing.is_empty() {
        return Err(KilnError::Weights(format!(
            "{}: the adapter does not fit this model ({}{}): is it an adapter of another base \
             model?",
            dir.join(ADAPTER_WEIGHTS).display(),
            if report.unexpected.is_empty() {
                String::new()
            } else {
                format!("no parameter for {}", peft_key(&report.unexpected[0]))
            },
            match missing.first() {
                Some(p) => format!(
                    "{}no tensor for {}",
                    if report.unexpected.is_empty() {
                        ""
                    } else {
                        "; "
                    },
                    peft_key(p)
                ),
                None => String::new(),
            }
        )));
    }
    Ok((model, adapter))
}

/// The base weights with the adapter folded in, as PEFT's `merge_and_unload()`: each adapted
/// layer's `weight += scaling · B A`, each saved module's parameters replaced.
pub fn merge(
    base: &mut BTreeMap<String, HostTensor>,
    adapter: &BTreeMap<String, HostTensor>,
    config: &LoraConfig,
) -> Result<usize> {
    let scaling = config.scaling() as f32;
    let mut merged = 0;
    for (path, a) in adapter
        .iter()
        .filter(|(p, _)| p.ends_with(".lora_a.weight"))
    {
        let layer = path.trim_end_matches(".lora_a.weight");
        let missing = |what: &str| {
            KilnError::Config(format!("the adapter's `{}` has no {what}", peft_key(path),))
        };
        let b = adapter
            .get(&format!("{layer}.lora_b.weight"))
            .ok_or_else(|| missing("lora_B beside it"))?;
        let w = base
            .get_mut(&format!("{layer}.weight"))
            .ok_or_else(|| missing("base weight in the model"))?;
        let (r, inp, out) = (a.shape[0], a.shape[1], b.shape[0]);
        if w.shape != [out, inp] || b.shape != [out, r] {
            return Err(KilnError::Config(format!(
                "the adapter's `{}` is {:?} and lora_B {:?}, which do not fit the base weight {:?}",
                peft_key(path),
                a.shape,
                b.shape,
                w.shape
            )));
        }
        use rayon::prelude::*;
        w.data.par_chunks_mut(inp).enumerate().for_each(|(o, row)| {
            for k in 0..r {
                let coef = scaling * b.data[o * r + k];
                let arow = &a.data[k * inp..(k + 1) * inp];
                row.iter_mut().zip(arow).for_each(|(w, a)| *w += coef * a);
            }
        });
        merged += 1;
    }
    for (path, t) in adapter.iter().filter(|(p, _)| !is_lora_param(p)) {
        match base.get_mut(path) {
            Some(w) if w.shape == t.shape => *w = t.clone(),
            _ => {
                return Err(KilnError::Config(format!(
                    "the adapter's `{}` {:?} has no parameter of that shape in the model",
                    peft_key(path),
                    t.shape
                )))
            }
        }
    }
    Ok(merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peft_names_round_trip() {
        let p = "model.layers.0.self_attn.q_proj.lora_a.weight";
        assert_eq!(
            peft_key(p),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        );
        assert_eq!(internal_key(&peft_key(p)).as_deref(), Some(p));
        assert_eq!(
            internal_key("base_model.model.x.lora_B.default.weight").as_deref(),
            Some("x.lora_b.weight")
        );
        assert_eq!(internal_key("model.x.weight"), None);
    }

    #[test]
    fn targets_match_like_peft() {
        let t = TargetModules::parse("q_proj, v_proj");
        assert!(t.matches("model.layers.0.self_attn.q_proj", false, &[]));
        assert!(!t.matches("model.layers.0.self_attn.k_proj", false, &[]));
        assert!(!t.matches("model.layers.0.self_attn.xq_proj", false, &[]));
        assert!(TargetModules::parse("all-linear").matches("a.b", false, &[]));
        assert!(!TargetModules::AllLinear.matches("lm_head", true, &[]));
        assert!(TargetModules::ModelDefault.matches("x.v_proj", false, &["q_proj", "v_proj"]));
    }

    #[test]
    fn modules_to_save_cover_their_submodules() {
        let adapter = Adapter {
            config: LoraConfig {
                r: 2,
                alpha: 4.0,
                dropout: 0.0,
                target_modules: TargetModules::AllLinear,
                use_rslora: false,
                modules_to_save: vec!["classifier".into()],
            },
            targeted: BTreeSet::new(),
            modules_to_save: vec!["classifier".into()],
            task_type: "SEQ_CLS",
        };
        assert!(adapter.owns("classifier.weight"));
        assert!(adapter.owns("classifier.dense.weight"));
        assert!(adapter.owns("bert.encoder.layer.0.attention.self.query.lora_a.weight"));
        assert!(!adapter.owns("bert.encoder.layer.0.attention.self.query.weight"));
        assert!(!adapter.owns("pre_classifier.weight"));
    }

    #[test]
    fn merging_adds_the_scaled_product() {
        let cfg = LoraConfig {
            r: 1,
            alpha: 2.0,
            dropout: 0.0,
            target_modules: TargetModules::AllLinear,
            use_rslora: false,
            modules_to_save: vec![],
        };
        let t = |shape: Vec<usize>, data: Vec<f32>| HostTensor { shape, data };
        let mut base = BTreeMap::from([("l.weight".to_string(), t(vec![2, 2], vec![1.0; 4]))]);
        let adapter = BTreeMap::from([
            ("l.lora_a.weight".to_string(), t(vec![1, 2], vec![1.0, 2.0])),
            (
                "l.lora_b.weight".to_string(),
                t(vec![2, 1], vec![3.0, -1.0]),
            ),
        ]);
        assert_eq!(merge(&mut base, &adapter, &cfg).unwrap(), 1);
        // W + 2 · [3, -1]ᵀ [1, 2]
        assert_eq!(base["l.weight"].data, vec![7.0, 13.0, -1.0, -3.0]);
    }

    #[test]
    fn factors_are_cut_beside_their_layer() {
        let base = |name: &str| match name {
            "q.weight" => ParamSplit::Sharded {
                axis: 0,
                range: 6..9,
                full: 9,
            },
            "o.weight" => ParamSplit::Sharded {
                axis: 1,
                range: 0..6,
                full: 9,
            },
            _ => ParamSplit::Replicated,
        };
        let cut = |axis, range| {
            Some(ParamSplit::Sharded {
                axis,
                range,
                full: 9,
            })
        };
        // Column-parallel: B by the weight's rows, A whole.
        assert_eq!(factor_split("q.lora_b.weight", base), cut(0, 6..9));
        assert_eq!(
            factor_split("q.lora_a.weight", base),
            Some(ParamSplit::Replicated)
        );
        // Row-parallel: A by the weight's columns, B whole.
        assert_eq!(factor_split("o.lora_a.weight", base), cut(1, 0..6));
        assert_eq!(
            factor_split("o.lora_b.weight", base),
            Some(ParamSplit::Replicated)
        );
        // A replicated layer's factors are whole; a weight is no factor.
        assert_eq!(
            factor_split("k.lora_b.weight", base),
            Some(ParamSplit::Replicated)
        );
        assert_eq!(factor_split("q.weight", base), None);
    }

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(1_843_200), "1,843,200");
        assert_eq!(thousands(999), "999");
    }
}

//! Adapters attached to a model's Linear layers (PEFT's `LoraLayer`): which layers match, their
//! factors initialised as PEFT does, the frozen base (held in bf16 under `--base-dtype bf16`),
//! the trainable-parameter line, and merging the factors back into the weights.

use crate::contract::ParamSplit;
use crate::error::{KilnError, Result};
use crate::formats::safetensors::HostTensor;
use crate::models::layers::{Linear, LoraFactor, LoraScale};
use crate::models::params::PathTracker;
use crate::ops::KilnBackend;
use burn::module::{Ignored, Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rand::{Rng, SeedableRng};
use serde_json::json;

use super::*;

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

    pub(crate) fn saves_whole(&self, path: &str) -> bool {
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
pub(crate) fn module_under(module: &str, name: &str) -> bool {
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
pub(crate) fn attach_from<B: KilnBackend, M: LoraTarget<B> + Module<B>>(
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
pub(crate) fn layer_kinds(paths: &[String]) -> String {
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
pub(crate) fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Every parameter the adapter does not own stops requiring a gradient.
pub(crate) fn freeze_base<B: Backend, M: Module<B>>(model: M, adapter: &Adapter) -> M {
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

pub(crate) fn thousands(n: usize) -> String {
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

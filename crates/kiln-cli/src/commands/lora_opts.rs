//! The LoRA options of `kiln train`, under TRL's names (`--use-peft`, `--lora-r`, …) with TRL's
//! defaults (`ModelConfig`: r 16, alpha 32, dropout 0.05); target modules default to PEFT's per
//! model type. `--adapter DIR` trains an existing PEFT adapter further instead.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use kiln::models::lora::{BaseDtype, LoraConfig, TargetModules};
use kiln::tasks::adapter::LoraSetup;

#[derive(Args, Clone, Default)]
#[command(next_help_heading = "LoRA (PEFT)")]
pub struct LoraOpts {
    /// Train a LoRA adapter on the frozen model and save it in PEFT's format (TRL's
    /// --use_peft); any other --lora-* option implies it.
    #[arg(long)]
    use_peft: bool,
    /// The adapters' rank [default: 16].
    #[arg(long, value_name = "R")]
    lora_r: Option<usize>,
    /// Their scale's numerator: the product is multiplied by alpha / r [default: 32].
    #[arg(long, value_name = "ALPHA")]
    lora_alpha: Option<f64>,
    /// Dropout on the adapters' input [default: 0.05].
    #[arg(long, value_name = "P")]
    lora_dropout: Option<f64>,
    /// Which Linear layers get an adapter: PEFT module names (`q_proj,v_proj`) or `all-linear`
    /// [default: the model type's, as PEFT's: q_proj,v_proj for Llama, query,value for BERT].
    #[arg(long, value_name = "NAMES")]
    lora_target_modules: Option<String>,
    /// Scale by alpha / √r (rank-stabilised LoRA).
    #[arg(long)]
    use_rslora: bool,
    /// Modules trained whole beside the adapters and saved with them (a sequence classifier's
    /// head always is, as in PEFT).
    #[arg(long, value_name = "NAMES")]
    lora_modules_to_save: Option<String>,
    /// Train this PEFT adapter folder further (`adapter_config.json` + `adapter_model.safetensors`,
    /// from kiln or PEFT), with its own rank, scale, dropout and target modules, as
    /// `PeftModel.from_pretrained(base, DIR, is_trainable=True)`.
    #[arg(long, value_name = "DIR")]
    adapter: Option<PathBuf>,
    /// Hold the frozen base in bf16 (half its memory; as loading it with
    /// torch_dtype=torch.bfloat16 for PEFT): its Linear weights and embeddings are rounded to
    /// bf16. Their products widen the weight a panel at a time and multiply in f32, or, with
    /// --bf16 on a CPU with bf16 arithmetic, read the bf16 weight as it is on the bf16 kernels
    /// (AMX tiles where the CPU has them). The adapter and its optimizer state stay f32. CPU only
    /// so far.
    #[arg(long, value_enum, value_name = "DTYPE", default_value = "f32")]
    base_dtype: BaseDtypeArg,
}

/// `--base-dtype`'s values.
#[derive(clap::ValueEnum, Clone, Copy, Default, PartialEq, Eq, Debug)]
enum BaseDtypeArg {
    #[default]
    F32,
    Bf16,
}

impl LoraOpts {
    /// What the frozen base is held in; bf16 needs an adapter to train (a whole model in bf16 is
    /// `--bf16`'s mixed precision, which keeps f32 master weights).
    pub fn base_dtype(&self) -> Result<BaseDtype> {
        match self.base_dtype {
            BaseDtypeArg::F32 => Ok(BaseDtype::F32),
            BaseDtypeArg::Bf16 if self.setup()?.is_none() => bail!(
                "--base-dtype bf16 holds a LoRA run's frozen base in bf16: add --use-peft (or \
                 --lora-* options, or --adapter DIR)"
            ),
            BaseDtypeArg::Bf16 => Ok(BaseDtype::Bf16),
        }
    }

    /// The adapter to train, or `None` when no LoRA option was given.
    pub fn setup(&self) -> Result<Option<LoraSetup>> {
        let fresh = self.config()?;
        match (&self.adapter, fresh) {
            (None, fresh) => Ok(fresh.map(LoraSetup::Fresh)),
            (Some(dir), None) => Ok(Some(LoraSetup::Continue(dir.clone()))),
            (Some(dir), Some(_)) => bail!(
                "--adapter {} brings its own LoRA settings (its adapter_config.json): drop \
                 --use-peft and the --lora-* options",
                dir.display()
            ),
        }
    }

    /// A fresh adapter's settings, or `None` when no --use-peft / --lora-* option was given.
    fn config(&self) -> Result<Option<LoraConfig>> {
        let any = self.use_peft
            || self.lora_r.is_some()
            || self.lora_alpha.is_some()
            || self.lora_dropout.is_some()
            || self.lora_target_modules.is_some()
            || self.use_rslora
            || self.lora_modules_to_save.is_some();
        if !any {
            return Ok(None);
        }
        let r = self.lora_r.unwrap_or(16);
        let alpha = self.lora_alpha.unwrap_or(32.0);
        let dropout = self.lora_dropout.unwrap_or(0.05);
        if r == 0 {
            bail!("--lora-r 0: the rank must be at least 1");
        }
        if !(alpha.is_finite() && alpha > 0.0) {
            bail!("--lora-alpha {alpha}: must be a positive number");
        }
        if !(0.0..1.0).contains(&dropout) {
            bail!("--lora-dropout {dropout}: must be at least 0 and below 1");
        }
        let target_modules = match &self.lora_target_modules {
            None => TargetModules::ModelDefault,
            Some(s) => match TargetModules::parse(s) {
                TargetModules::Names(n) if n.is_empty() => {
                    bail!("--lora-target-modules {s:?}: names no module")
                }
                t => t,
            },
        };
        let modules_to_save = self
            .lora_modules_to_save
            .iter()
            .flat_map(|s| s.split(','))
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        Ok(Some(LoraConfig {
            r,
            alpha,
            dropout,
            target_modules,
            use_rslora: self.use_rslora,
            modules_to_save,
        }))
    }
}

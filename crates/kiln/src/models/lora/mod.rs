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

mod config;
pub use config::*;
mod layer;
pub use layer::*;
mod save_and_load;
pub use save_and_load::*;

impl std::fmt::Display for TargetModules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ModelDefault => f.write_str("(the model's default)"),
            Self::AllLinear => f.write_str("all-linear"),
            Self::Names(n) => f.write_str(&n.join(",")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::layer::*;
    use super::save_and_load::*;
    use super::*;
    use crate::contract::ParamSplit;
    use crate::formats::safetensors::HostTensor;

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

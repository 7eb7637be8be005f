//! Qwen2: Llama's layers with biases on q, k and v always, and the config's `sliding_window` on
//! the layers from `max_window_layers` on when `use_sliding_window` (else per `layer_types`).
//! transformers' `modeling_qwen2.py` is the same model.

use super::decoder::DecoderFamily;
use super::llama::config::{LayerRules, LlamaConfig};
use super::llama::Llama;

/// `model_type: "qwen2"`.
pub static FAMILY: DecoderFamily<Llama> = DecoderFamily {
    model_type: "qwen2",
    class_prefix: "Qwen2",
    read_config: |path, bytes| LlamaConfig::from_bytes(path, bytes, RULES),
};

/// q/k/v biases always; the layers from `max_window_layers` on slide when `use_sliding_window`.
pub const RULES: LayerRules = LayerRules::QWEN2;

#[cfg(test)]
mod tests {
    use super::*;

    fn q(extra: &str) -> LlamaConfig {
        let json = format!(
            r#"{{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                "num_attention_heads": 2, "model_type": "qwen2", "sliding_window": 6,
                "num_hidden_layers": 2 {extra}}}"#
        );
        (FAMILY.read_config)(std::path::Path::new("config.json"), json.as_bytes()).unwrap()
    }

    #[test]
    fn biases_always_and_windows_from_max_window_layers() {
        assert_eq!(
            q("").window(1),
            None,
            "use_sliding_window defaults to false"
        );
        let on = q(r#", "use_sliding_window": true, "max_window_layers": 1"#);
        assert_eq!((on.window(0), on.window(1)), (None, Some(6)));
        assert!(on.qkv_bias() && !on.attention_bias);
        let typed = q(r#", "layer_types": ["sliding_attention", "full_attention"]"#);
        assert_eq!((typed.window(0), typed.window(1)), (Some(6), None));
    }
}

//! Mistral: Llama's layers, each attending through the config's `sliding_window` (an explicit
//! `null` attends to the whole past, as Mistral v0.2 on sets it), unless `layer_types` says
//! otherwise. transformers' `modeling_mistral.py` is the same model.

use super::decoder::DecoderFamily;
use super::llama::config::{LayerRules, LlamaConfig};
use super::llama::Llama;

/// `model_type: "mistral"`.
pub static FAMILY: DecoderFamily<Llama> = DecoderFamily {
    model_type: "mistral",
    class_prefix: "Mistral",
    read_config: |path, bytes| LlamaConfig::from_bytes(path, bytes, RULES),
};

/// q/k/v biases only with `attention_bias`; every layer slides.
pub const RULES: LayerRules = LayerRules::MISTRAL;

#[cfg(test)]
mod tests {
    use super::*;

    fn read(json: &str) -> LlamaConfig {
        (FAMILY.read_config)(std::path::Path::new("config.json"), json.as_bytes()).unwrap()
    }

    fn cfg(extra: &str) -> String {
        format!(
            r#"{{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                "num_attention_heads": 2, "num_key_value_heads": 1, "model_type": "mistral" {extra}}}"#
        )
    }

    #[test]
    fn every_layer_slides_unless_the_window_is_null() {
        let mistral = read(&cfg(r#", "sliding_window": 6"#));
        assert_eq!(mistral.window(0), Some(6));
        let null = read(&cfg(r#", "sliding_window": null"#));
        assert_eq!(null.window(0), None);
        // An explicit null is written back (transformers reads an absent one as 4096), and an
        // unset head_dim is not written at all (transformers 5 would take a null as the size).
        let saved = serde_json::to_value(&null).unwrap();
        assert!(saved.as_object().unwrap()["sliding_window"].is_null());
        assert!(saved.get("head_dim").is_none());
        let bad = (FAMILY.read_config)(
            std::path::Path::new("config.json"),
            cfg(r#", "sliding_window": 0"#).as_bytes(),
        );
        assert!(bad.unwrap_err().to_string().contains("sliding_window"));
    }
}

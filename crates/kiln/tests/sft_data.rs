//! kiln's chat templates and supervised fine-tuning data preparation against transformers and TRL
//! (tests/fixtures/sft_lora, from tests/fixtures/gen_sft_lora.py; no Python here):
//! - `chat_templates.json`: five Hub templates (SmolLM2, Qwen2.5, Llama 3, Llama 3.2, Mistral)
//!   rendered by `apply_chat_template`, the text and its SmolLM2 token ids, and the templates' own
//!   errors;
//! - `sft_masks.json`: `SFTTrainer`'s dataset preparation (tokenized rows and their completion /
//!   assistant masks, labels, truncation, dropped rows) and its collator (padded and padding-free).
//!
//! Token ids are SmolLM2-135M-Instruct's: every test needs its tokenizer, converted from the GGUF
//! asset (scripts/fetch-assets), and skips without it.

use std::path::{Path, PathBuf};

use kiln::data::chat_template::{special_tokens, ChatTemplate, Message, RenderOptions};
use kiln::data::sft::{
    assistant_mask, build_labels, collate, prepare_labelled_row, prepare_row, LabelledExample,
    SftError, SftExample, SftOptions, IGNORE_INDEX,
};
use kiln_testkit::common::{repo_root, smollm2_tokenizer};
use serde_json::{Map, Value as Json};
use tokenizers::Tokenizer;

fn fixture(name: &str) -> Json {
    let path = repo_root().join("tests/fixtures/sft_lora").join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// SmolLM2's tokenizer and its folder, or `None` (the test then skips).
fn smollm2() -> Option<(Tokenizer, PathBuf)> {
    // Converted once per test binary: the tests run in parallel and would write over each other.
    static DIR: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    let dir = DIR
        .get_or_init(|| {
            smollm2_tokenizer(&Path::new(env!("CARGO_TARGET_TMPDIR")).join("sft-smollm2"))
        })
        .clone()?;
    let tok = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    Some((tok, dir))
}

/// The fixture's case called `name`.
fn named_case<'a>(fx: &'a Json, name: &str) -> &'a Json {
    fx["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no fixture case {name}"))
}

fn ids(v: &Json) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

fn ints(v: &Json) -> Vec<i64> {
    serde_json::from_value(v.clone()).unwrap()
}

fn mask(v: &Json) -> Vec<u8> {
    serde_json::from_value(v.clone()).unwrap()
}

fn messages(v: &Json) -> Vec<Message> {
    serde_json::from_value(v.clone()).unwrap()
}

fn object(v: &Json) -> Map<String, Json> {
    v.as_object().expect("a JSON object").clone()
}

#[test]
fn chat_templates_render_and_tokenize_as_transformers() {
    let Some((tok, _)) = smollm2() else { return };
    let fx = fixture("chat_templates.json");
    let mut checked = 0;
    for t in fx["templates"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        // Every variable the template saw: the tokenizer's special tokens, overridden by kwargs.
        let mut template = ChatTemplate::new(t["template"].as_str().unwrap(), None, None).unwrap();
        for (k, v) in t["template_variables"].as_object().unwrap() {
            template = template.with_variable(k, v.clone()).unwrap();
        }
        for case in t["cases"].as_array().unwrap() {
            let what = format!("{name}/{}", case["name"].as_str().unwrap());
            let msgs = messages(&case["messages"]);
            let tools: Option<Vec<Json>> = case.get("tools").map(|t| t.as_array().unwrap().clone());
            let extra = case.get("extra_kwargs").map(object);
            let rendered = template.render_with(
                &msgs,
                &RenderOptions {
                    add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
                    tools: tools.as_deref(),
                    variables: extra.as_ref(),
                },
            );
            if let Some(err) = case.get("error") {
                let want = err["message"].as_str().unwrap();
                match rendered {
                    Ok(r) => panic!("{what}: rendered {:?}, expected the error {want:?}", r.text),
                    Err(e) => assert!(
                        e.to_string().contains(want),
                        "{what}: error {e:?} does not contain {want:?}"
                    ),
                }
            } else {
                let rendered = rendered.unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(
                    rendered.text,
                    case["text"].as_str().unwrap(),
                    "{what}: text"
                );
                assert!(rendered.generation_spans.is_empty(), "{what}");
                let enc = tok.encode(rendered.text.as_str(), false).unwrap();
                assert_eq!(enc.get_ids(), ids(&case["ids"]), "{what}: ids");
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 33, "every template case of the fixture");
}

/// Tool schemas reach a template with their keys in the order given, as Python's dicts keep them
/// (`tool | tojson` prints them so): the fixture's tool cases above would catch a sorted map, and
/// this names the cause if one returns (serde_json without its `preserve_order` feature).
#[test]
fn parsed_json_objects_keep_their_key_order() {
    let m: Map<String, Json> =
        serde_json::from_str(r#"{"type": "function", "function": {}}"#).unwrap();
    assert_eq!(m.keys().collect::<Vec<_>>(), ["type", "function"]);
}

/// The template and options TRL prepared a case with.
fn case_setup(fx: &Json, case: &Json, dir: &Path) -> (ChatTemplate, SftOptions, u32, bool) {
    let cfg = &case["sft_config"];
    let resolved = &case["resolved"];
    let assistant_only = cfg["assistant_only_loss"].as_bool().unwrap_or(false);
    // The assistant-only cases ran with the `{% generation %}` variant of SmolLM2's template.
    let source = if assistant_only {
        fx["smollm2_generation_template"].as_str().unwrap()
    } else {
        fx["smollm2_template"].as_str().unwrap()
    };
    let mut template = ChatTemplate::new(source, None, None).unwrap();
    for (k, v) in special_tokens(dir).unwrap() {
        template = template.with_variable(&k, Json::String(v)).unwrap();
    }
    let options = SftOptions {
        completion_only_loss: cfg["completion_only_loss"].as_bool(),
        assistant_only_loss: assistant_only,
        // SFTConfig's default max_length is 1024; the fixture sets it in every case (null: none).
        max_length: match cfg.get("max_length") {
            None => Some(1024),
            Some(v) => v.as_u64().map(|n| n as usize),
        },
        eos_token: Some(resolved["eos_token"].as_str().unwrap().to_string()),
        ..SftOptions::default()
    };
    let pad = resolved["pad_token_id"].as_u64().unwrap() as u32;
    let padding_free = resolved["padding_free"].as_bool().unwrap();
    (template, options, pad, padding_free)
}

/// `assistant_only_loss` with SmolLM2's stock template, which has no `{% generation %}` tags:
/// each assistant turn found by rendering turn by turn gives TRL's masks and labels for every
/// assistant-only case of the fixture, which TRL made with the tagged variant of the template.
#[test]
fn assistant_masks_without_generation_tags_equal_trls() {
    let Some((tok, dir)) = smollm2() else { return };
    let fx = fixture("sft_masks.json");
    let mut stock =
        ChatTemplate::new(fx["smollm2_template"].as_str().unwrap(), None, None).unwrap();
    for (k, v) in special_tokens(&dir).unwrap() {
        stock = stock.with_variable(&k, Json::String(v)).unwrap();
    }
    assert!(!stock.has_generation_blocks());
    let mut rows_checked = 0;
    for case in fx["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        if case["sft_config"]["assistant_only_loss"].as_bool() != Some(true) {
            continue;
        }
        let (_, options, _, _) = case_setup(&fx, case, &dir);
        let rows = case["rows"].as_array().unwrap();
        let tokenized = case["tokenized"].as_array().unwrap();
        for (i, (row, want)) in rows.iter().zip(tokenized).enumerate() {
            let what = format!("{name} row {i}");
            let ex = prepare_row(&object(row), &tok, Some(&stock), &options)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(ex.input_ids, ids(&want["input_ids"]), "{what}: input_ids");
            assert_eq!(
                ex.assistant_mask,
                want.get("assistant_masks").map(mask),
                "{what}: assistant_masks"
            );
            rows_checked += 1;
        }
    }
    assert!(rows_checked > 0, "the fixture has assistant-only cases");
}

#[test]
fn sft_rows_are_prepared_and_collated_as_trl() {
    let Some((tok, dir)) = smollm2() else { return };
    let fx = fixture("sft_masks.json");
    let mut checked = Vec::new();
    for case in fx["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        if case["sft_config"]["packing"].as_bool() == Some(true) {
            continue; // packing_is_trls_best_fit_decreasing
        }
        let (template, options, pad, padding_free) = case_setup(&fx, case, &dir);
        let rows = case["rows"].as_array().unwrap();
        let tokenized = case["tokenized"].as_array().unwrap();
        assert_eq!(rows.len(), tokenized.len(), "{name}");

        // Tokenization and masks, before truncation (TRL's tokenize_fn).
        let mut prepared: Vec<LabelledExample> = Vec::new();
        for (i, (row, want)) in rows.iter().zip(tokenized).enumerate() {
            let what = format!("{name} row {i}");
            let row = object(row);
            let ex: SftExample = prepare_row(&row, &tok, Some(&template), &options)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(ex.input_ids, ids(&want["input_ids"]), "{what}: input_ids");
            assert_eq!(
                ex.completion_mask,
                want.get("completion_mask").map(mask),
                "{what}: completion_mask"
            );
            assert_eq!(
                ex.assistant_mask,
                want.get("assistant_masks").map(mask),
                "{what}: assistant_masks"
            );
            // Labels, truncation, and the rows TRL drops (no target left).
            let labelled = build_labels(&ex, &options);
            let direct = prepare_labelled_row(&row, &tok, Some(&template), &options);
            match (labelled, direct) {
                (Ok(l), Ok(d)) => {
                    assert_eq!(l, d, "{what}");
                    prepared.push(l);
                }
                (Err(SftError::NoTarget { max_length }), Err(SftError::NoTarget { .. })) => {
                    assert_eq!(Some(max_length), options.max_length, "{what}");
                }
                (l, d) => panic!("{what}: {l:?} / {d:?}"),
            }
        }
        let want: Vec<LabelledExample> = case["prepared"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| LabelledExample {
                input_ids: ids(&r["input_ids"]),
                labels: ints(&r["labels"]),
            })
            .collect();
        assert_eq!(prepared, want, "{name}: prepared rows");

        // The collator on every prepared row, in order.
        let batch = collate(&prepared, pad, padding_free, None);
        let col = &case["collated"];
        let rows_of = |v: &Json| -> Vec<Vec<i64>> { serde_json::from_value(v.clone()).unwrap() };
        let widen = |m: &[Vec<u32>]| -> Vec<Vec<i64>> {
            m.iter()
                .map(|r| r.iter().map(|&x| i64::from(x)).collect())
                .collect()
        };
        assert_eq!(
            widen(&batch.input_ids),
            rows_of(&col["input_ids"]),
            "{name}"
        );
        assert_eq!(batch.labels, rows_of(&col["labels"]), "{name}: labels");
        if padding_free {
            assert!(col.get("attention_mask").is_none(), "{name}");
            assert_eq!(batch.attention_mask, None, "{name}");
            let positions = batch.position_ids.expect("padding-free position ids");
            assert_eq!(widen(&positions), rows_of(&col["position_ids"]), "{name}");
            // The sequence boundaries TRL also passes (flash-attention's cu_seq_lens) are where
            // the position ids restart.
            let mut cu: Vec<i64> = positions[0]
                .iter()
                .enumerate()
                .filter(|(_, &p)| p == 0)
                .map(|(i, _)| i as i64)
                .collect();
            cu.push(positions[0].len() as i64);
            assert_eq!(cu, ints(&col["cu_seq_lens_q"]), "{name}: cu_seq_lens");
            assert!(batch.labels[0]
                .iter()
                .zip(&positions[0])
                .all(|(&l, &p)| p != 0 || l == IGNORE_INDEX));
        } else {
            let am = batch.attention_mask.expect("padded attention mask");
            let am: Vec<Vec<i64>> = am
                .iter()
                .map(|r| r.iter().map(|&x| i64::from(x)).collect())
                .collect();
            assert_eq!(
                am,
                rows_of(&col["attention_mask"]),
                "{name}: attention_mask"
            );
            assert_eq!(batch.position_ids, None, "{name}");
            assert!(col.get("position_ids").is_none(), "{name}");
        }
        checked.push(name.to_string());
    }
    assert_eq!(
        checked,
        [
            "text",
            "prompt_completion",
            "prompt_completion_full_loss",
            "prompt_completion_padding_free",
            "messages",
            "messages_assistant_only",
            "conversational_prompt_completion",
            "conversational_prompt_completion_assistant_only",
        ]
    );
}

#[test]
fn dropped_rows_are_those_trl_drops() {
    // prompt_completion: the long-prompt row keeps no completion token after truncation to 32.
    let Some((tok, dir)) = smollm2() else { return };
    let fx = fixture("sft_masks.json");
    let case = named_case(&fx, "prompt_completion");
    let (template, options, _, _) = case_setup(&fx, case, &dir);
    let rows = case["rows"].as_array().unwrap();
    assert_eq!(case["prepared"].as_array().unwrap().len(), rows.len() - 1);
    let err = prepare_labelled_row(&object(&rows[4]), &tok, Some(&template), &options).unwrap_err();
    assert!(
        matches!(err, SftError::NoTarget { max_length: 32 }),
        "{err:?}"
    );
}

/// `--packing`: TRL's best-fit-decreasing packing (`text_packed_bfd`: rows cut at max_length, then
/// packed into sequences of at most max_length, longest first) gives the same sequences, in the
/// same order, as kiln's `SftSet::pack`; the packed batch is TRL's padding-free collation, with
/// each position's target the next label and no target across a sequence boundary.
#[test]
fn packing_is_trls_best_fit_decreasing() {
    use kiln::contract::BatchSource;
    use kiln::tasks::sft::SftSet;
    let Some((tok, dir)) = smollm2() else { return };
    let fx = fixture("sft_masks.json");
    let case = named_case(&fx, "text_packed_bfd");
    let (template, options, pad, _) = case_setup(&fx, case, &dir);
    let examples: Vec<LabelledExample> = case["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| prepare_labelled_row(&object(row), &tok, Some(&template), &options).unwrap())
        .collect();
    let capacity = case["sft_config"]["max_length"].as_u64().unwrap() as usize;
    let set = SftSet {
        examples,
        pad_id: pad,
        targets: 0,
        packed: None,
        pad_to_multiple_of: None,
    }
    .pack(capacity);
    let want = case["prepared"].as_array().unwrap();
    assert_eq!(set.len(), want.len(), "packed sequences");
    let bins = set.packed.clone().unwrap();
    for (k, (bin, w)) in bins.iter().zip(want).enumerate() {
        let got: Vec<u32> = bin
            .iter()
            .flat_map(|&i| set.examples[i].input_ids.clone())
            .collect();
        let lens: Vec<i64> = bin
            .iter()
            .map(|&i| set.examples[i].input_ids.len() as i64)
            .collect();
        assert_eq!(got, ids(&w["input_ids"]), "sequence {k}: input_ids");
        assert_eq!(lens, ints(&w["seq_lengths"]), "sequence {k}: seq_lengths");
    }
    // TRL's collator on the whole packed set, one row; kiln's batch of both sequences.
    let (batch, targets) = set.batch(&(0..set.len()).collect::<Vec<_>>());
    let col = &case["collated"];
    let row = |v: &Json| -> Vec<i64> {
        let rows: Vec<Vec<i64>> = serde_json::from_value(v.clone()).unwrap();
        rows.into_iter().next().unwrap()
    };
    assert_eq!(batch.ids, row(&col["input_ids"]));
    let labels = row(&col["labels"]);
    let shifted: Vec<i64> = labels[1..].iter().copied().chain([IGNORE_INDEX]).collect();
    assert_eq!(targets, shifted, "targets: TRL's labels shifted by one");
    let mut cu = vec![0i64];
    for n in &batch.segments {
        cu.push(cu.last().unwrap() + *n as i64);
    }
    assert_eq!(cu, ints(&col["cu_seq_lens_q"]), "sequence boundaries");
}

/// Turn-by-turn masks against transformers' `{% generation %}` masks on every chat template TRL
/// ships with the tags (`template_masks.json`, `gen_template_masks.py`). Each template either
/// gives transformers' mask exactly, or is refused in one sentence (it renders earlier turns
/// differently once later ones follow), or its tags also take in the end of the generation
/// prompt (a header, a newline, an empty think block: the tagged span starts earlier and ends
/// where the turn ends) — nothing else.
#[test]
fn turn_masks_against_every_trl_template_with_tags() {
    let Some((tok, dir)) = smollm2() else { return };
    let fx = fixture("template_masks.json");
    let (mut equal, mut refused, mut wider) = (0, 0, 0);
    for case in fx["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let mut t = ChatTemplate::new(case["template"].as_str().unwrap(), None, None).unwrap();
        for (k, v) in special_tokens(&dir).unwrap() {
            t = t.with_variable(&k, Json::String(v)).unwrap();
        }
        let messages: Vec<Message> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let turns = match t.render_assistant_turns(&messages, &RenderOptions::default()) {
            Ok(r) => r,
            Err(e) => {
                let e = e.to_string();
                assert!(
                    e.contains("differently") && e.contains("{% generation %}"),
                    "{name}: {e}"
                );
                refused += 1;
                continue;
            }
        };
        assert_eq!(turns.text, case["text"].as_str().unwrap(), "{name}: text");
        let enc = tok.encode_char_offsets(turns.text.as_str(), false).unwrap();
        assert_eq!(enc.get_ids(), &ids(&case["input_ids"])[..], "{name}: ids");
        let got = assistant_mask(enc.get_offsets(), &turns.generation_char_spans());
        if got == mask(&case["assistant_masks"]) {
            equal += 1;
            continue;
        }
        let tagged = t.render(&messages, false).unwrap();
        assert_eq!(
            tagged.generation_spans.len(),
            turns.generation_spans.len(),
            "{name}"
        );
        for (tag, turn) in tagged.generation_spans.iter().zip(&turns.generation_spans) {
            assert!(
                tag.start < turn.start && tag.end == turn.end,
                "{name}: tagged {tag:?}, turn {turn:?} in {:?}",
                turns.text
            );
        }
        wider += 1;
    }
    eprintln!("{equal} equal, {refused} refused, {wider} tagged from inside the generation prompt");
    assert!(equal >= 18, "{equal} templates give transformers' mask");
    assert_eq!(
        equal + refused + wider,
        fx["cases"].as_array().unwrap().len()
    );
}

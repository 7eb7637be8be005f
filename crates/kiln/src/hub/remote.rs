//! Hugging Face Hub ids (`bert-base-uncased`, `org/name`, `org/name@revision`) wherever a model
//! folder, a tokenizer or a config is asked for, through the `hf-hub` crate: files land in the
//! cache layout Python's `huggingface_hub` uses (`models--org--name/snapshots/<commit>/…`), so a
//! model either side downloaded is not fetched again. The environment is read as Python reads it:
//! `HF_HOME`, `HF_HUB_CACHE`, `HF_ENDPOINT`, `HF_TOKEN` (else the token file `huggingface-cli
//! login` writes), `HF_HUB_OFFLINE`.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hf_hub::api::sync::{Api, ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};

use crate::error::{KilnError, Result};

/// A repository on the Hub and the revision (branch, tag or commit) asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubId {
    pub repo: String,
    pub revision: String,
}

impl HubId {
    /// `name`, `org/name`, with `@revision` optionally: the characters the Hub allows in ids
    /// (letters, digits, `-`, `_`, `.`), no `..` or `--`, at most 96 characters.
    pub fn parse(s: &str) -> Option<Self> {
        let (repo, revision) = match s.split_once('@') {
            Some((r, rev)) if !rev.is_empty() => (r, rev),
            Some(_) => return None,
            None => (s, "main"),
        };
        let parts: Vec<&str> = repo.split('/').collect();
        let valid_part = |p: &&str| {
            !p.is_empty()
                && !p.starts_with(['.', '-'])
                && !p.ends_with(['.', '-'])
                && !p.contains("..")
                && !p.contains("--")
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        if parts.len() > 2 || repo.len() > 96 || !parts.iter().all(valid_part) {
            return None;
        }
        Some(Self {
            repo: repo.to_string(),
            revision: revision.to_string(),
        })
    }

    fn repo(&self, kind: RepoType) -> Repo {
        Repo::with_revision(self.repo.clone(), kind, self.revision.clone())
    }
}

impl std::fmt::Display for HubId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.revision == "main" {
            write!(f, "{}", self.repo)
        } else {
            write!(f, "{}@{}", self.repo, self.revision)
        }
    }
}

/// What a command needs of a model argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// A whole model folder: config, weights (one file or shards), tokenizer files.
    Model,
    /// `config.json` alone (`--from-config`).
    Config,
    /// `tokenizer.json` alone (`--tokenizer`).
    Tokenizer,
}

/// Files a model folder may have beside its config and weights; fetched when the repo has them.
const MODEL_EXTRAS: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
];

/// A local path as given, or the cached copy of a Hub repo's files for `need`: the snapshot
/// folder for [`Need::Model`], the file itself for the others. An argument that is neither an
/// existing path nor a valid Hub id is returned as it is, for the caller's "not found".
pub fn resolve(arg: &Path, need: Need) -> Result<PathBuf> {
    if arg.exists() {
        return Ok(arg.to_path_buf());
    }
    let Some(id) = arg.to_str().and_then(HubId::parse) else {
        return Ok(arg.to_path_buf());
    };
    Hub::from_env()?.model_files(&id, need)
}

/// The Hub as the environment configures it.
pub struct Hub {
    api: Api,
    cache: Cache,
    endpoint: String,
    offline: bool,
}

/// Why a file could not be had.
enum Missing {
    /// The repo exists but has no such file.
    File,
    /// Offline, and the cache does not hold it.
    NotCached,
    Fatal(KilnError),
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl Hub {
    pub fn from_env() -> Result<Self> {
        let home = env("HF_HOME")
            .map(PathBuf::from)
            .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".cache").join("huggingface")));
        let cache = match (env("HF_HUB_CACHE"), &home) {
            (Some(c), _) => Cache::new(c.into()),
            (None, Some(h)) => Cache::new(h.join("hub")),
            (None, None) => Cache::from_env(),
        };
        let token = env("HF_TOKEN").or_else(|| {
            let file = home.as_ref()?.join("token");
            let t = std::fs::read_to_string(file).ok()?;
            Some(t.trim().to_string()).filter(|t| !t.is_empty())
        });
        let endpoint = env("HF_ENDPOINT")
            .unwrap_or_else(|| "https://huggingface.co".into())
            .trim_end_matches('/')
            .to_string();
        let offline = env("HF_HUB_OFFLINE")
            .is_some_and(|v| ["1", "ON", "YES", "TRUE"].contains(&v.to_uppercase().as_str()));
        let api = ApiBuilder::from_cache(cache.clone())
            .with_endpoint(endpoint.clone())
            .with_token(token)
            .with_progress(std::io::stderr().is_terminal())
            .build()
            .map_err(|e| KilnError::Config(format!("the Hugging Face Hub client: {e}")))?;
        Ok(Self {
            api,
            cache,
            endpoint,
            offline,
        })
    }

    /// The cached files of model repo `id` that `need` asks for (downloaded unless cached).
    pub fn model_files(&self, id: &HubId, need: Need) -> Result<PathBuf> {
        let repo = id.repo(RepoType::Model);
        match need {
            Need::Config => self.required(id, &repo, "config.json"),
            Need::Tokenizer => self.required(id, &repo, "tokenizer.json"),
            Need::Model => {
                let config = self.required(id, &repo, "config.json")?;
                self.weights(id, &repo)?;
                for f in MODEL_EXTRAS {
                    self.optional(id, &repo, f)?;
                }
                Ok(config
                    .parent()
                    .expect("a cached file is in a snapshot folder")
                    .to_path_buf())
            }
        }
    }

    /// `model.safetensors`, else the shards `model.safetensors.index.json` lists.
    fn weights(&self, id: &HubId, repo: &Repo) -> Result<()> {
        if self.optional(id, repo, "model.safetensors")?.is_some() {
            return Ok(());
        }
        let Some(index) = self.optional(id, repo, "model.safetensors.index.json")? else {
            if self.offline {
                return Err(self.not_cached(id, "model.safetensors"));
            }
            let pickle = if !self.offline && self.exists(repo, "pytorch_model.bin") {
                " (it has only pytorch_model.bin, a pickle kiln does not read: convert it with \
                 transformers' save_pretrained(..., safe_serialization=True))"
            } else {
                ""
            };
            return Err(KilnError::Config(format!(
                "Hub model {id} has no model.safetensors or model.safetensors.index.json{pickle}"
            )));
        };
        let json: serde_json::Value = super::read_json(&index)?;
        let mut shards: Vec<&str> = json["weight_map"]
            .as_object()
            .ok_or_else(|| {
                KilnError::Config(format!(
                    "{} (Hub model {id}): no \"weight_map\" object",
                    index.display()
                ))
            })?
            .values()
            .filter_map(|v| v.as_str())
            .collect();
        shards.sort_unstable();
        shards.dedup();
        for shard in shards {
            // Shard names come from the repo: only plain file names are fetched.
            if shard.contains('/') || shard.contains("..") {
                return Err(KilnError::Config(format!(
                    "{} (Hub model {id}): shard {shard:?} is not a file name",
                    index.display()
                )));
            }
            self.required(id, repo, shard)?;
        }
        Ok(())
    }

    fn required(&self, id: &HubId, repo: &Repo, file: &str) -> Result<PathBuf> {
        match self.fetch(id, repo, file) {
            Ok(p) => Ok(p),
            Err(Missing::File) => Err(KilnError::Config(format!("Hub repo {id} has no {file}"))),
            Err(Missing::NotCached) => Err(self.not_cached(id, file)),
            Err(Missing::Fatal(e)) => Err(e),
        }
    }

    /// A file the repo may lack: `None` when it does (or, offline, when the cache lacks it).
    fn optional(&self, id: &HubId, repo: &Repo, file: &str) -> Result<Option<PathBuf>> {
        match self.fetch(id, repo, file) {
            Ok(p) => Ok(Some(p)),
            Err(Missing::File | Missing::NotCached) => Ok(None),
            Err(Missing::Fatal(e)) => Err(e),
        }
    }

    fn not_cached(&self, id: &HubId, file: &str) -> KilnError {
        KilnError::Config(format!(
            "{file} of Hub repo {id} is not in the cache ({}) and HF_HUB_OFFLINE is set",
            self.cache.path().display()
        ))
    }

    /// Whether the repo lists `file` (asked without downloading it).
    fn exists(&self, repo: &Repo, file: &str) -> bool {
        self.api
            .repo(repo.clone())
            .info()
            .is_ok_and(|info| info.siblings.iter().any(|s| s.rfilename == file))
    }

    /// One file from the cache, else from the Hub (unless offline).
    fn fetch(&self, id: &HubId, repo: &Repo, file: &str) -> std::result::Result<PathBuf, Missing> {
        if self.offline {
            return self
                .cache
                .repo(repo.clone())
                .get(file)
                .ok_or(Missing::NotCached);
        }
        let api: ApiRepo = self.api.repo(repo.clone());
        // Another process (a `kiln launch` rank) downloading the same file holds its lock:
        // wait for it, then the file comes from the cache.
        let started = Instant::now();
        loop {
            match api.get(file) {
                Ok(p) => return Ok(p),
                Err(ApiError::LockAcquisition(_))
                    if started.elapsed() < Duration::from_secs(3600) =>
                {
                    std::thread::sleep(Duration::from_secs(2));
                }
                Err(e) => return Err(self.explain(id, file, e)),
            }
        }
    }

    /// One sentence for a failed request: a missing repo, a gated one, a network failure.
    fn explain(&self, id: &HubId, file: &str, e: ApiError) -> Missing {
        let fatal = |m: String| Missing::Fatal(KilnError::Config(m));
        let ApiError::RequestError(err) = &e else {
            return fatal(format!("Hub repo {id}, {file}: {e}"));
        };
        match err.as_ref() {
            ureq::Error::Status(code, resp) => {
                let reason = resp.header("x-error-code").unwrap_or("");
                match (code, reason) {
                    (_, "GatedRepo") => fatal(format!(
                        "Hub repo {id} is gated: accept its conditions on {}/{} and set HF_TOKEN \
                         to a token of that account",
                        self.endpoint, id.repo
                    )),
                    (_, "RepositoryNotFound") | (401, "") => fatal(format!(
                        "Hub repo {id} does not exist (or it is private: set HF_TOKEN), and no \
                         local folder has that name"
                    )),
                    (_, "RevisionNotFound") => fatal(format!(
                        "Hub repo {} has no revision {:?}",
                        id.repo, id.revision
                    )),
                    (404, _) => Missing::File,
                    (403, _) => fatal(format!(
                        "Hub repo {id}: access refused (HTTP 403) — the token set in HF_TOKEN \
                         has no access to it"
                    )),
                    (c, _) => fatal(format!(
                        "Hub repo {id}, {file}: HTTP {c} from {}",
                        self.endpoint
                    )),
                }
            }
            ureq::Error::Transport(t) => fatal(format!(
                "cannot reach the Hugging Face Hub at {} for {id} ({t}); files downloaded \
                 before are used with HF_HUB_OFFLINE=1",
                self.endpoint
            )),
        }
    }

    /// A dataset repo's files under a revision (for its Parquet conversion), as listed by the Hub.
    pub fn dataset_files(&self, id: &HubId) -> Result<Vec<String>> {
        if self.offline {
            return Err(KilnError::Config(format!(
                "Hub dataset {id}: listing its files needs the network, and HF_HUB_OFFLINE is set"
            )));
        }
        let repo = id.repo(RepoType::Dataset);
        match self.api.repo(repo).info() {
            Ok(info) => Ok(info.siblings.into_iter().map(|s| s.rfilename).collect()),
            Err(e) => Err(match self.explain(id, "the file list", e) {
                Missing::File | Missing::NotCached => KilnError::Config(format!(
                    "Hub dataset {} does not exist (or it is private: set HF_TOKEN)",
                    id.repo
                )),
                Missing::Fatal(e) => e,
            }),
        }
    }

    /// One file of a dataset repo, from the cache or downloaded.
    pub fn dataset_file(&self, id: &HubId, file: &str) -> Result<PathBuf> {
        let repo = id.repo(RepoType::Dataset);
        match self.fetch(id, &repo, file) {
            Ok(p) => Ok(p),
            Err(Missing::File) => Err(KilnError::Config(format!("Hub dataset {id} has no {file}"))),
            Err(Missing::NotCached) => Err(self.not_cached(id, file)),
            Err(Missing::Fatal(e)) => Err(e),
        }
    }
}

/// The revision under which the Hub serves every public dataset converted to Parquet.
pub const PARQUET_REVISION: &str = "refs/convert/parquet";

/// Local folders of a Hub dataset's splits, from its Parquet conversion (`CONFIG/SPLIT/*.parquet`
/// under [`PARQUET_REVISION`]): `train_split` (default `train`) when `want_train`, and
/// `eval_split`, else `validation`, else `test` (none if neither exists). Each folder holds the
/// split's Parquet files, downloaded into the cache.
pub fn dataset_splits(
    name: &str,
    config: Option<&str>,
    train_split: Option<&str>,
    eval_split: Option<&str>,
    want_train: bool,
) -> Result<(Option<PathBuf>, Option<PathBuf>)> {
    let repo = HubId::parse(name)
        .filter(|id| id.revision == "main")
        .ok_or_else(|| {
            KilnError::Config(format!(
                "--dataset-name {name:?} is not a Hub dataset id (`name` or `org/name`; its \
                 Parquet conversion is always read)"
            ))
        })?
        .repo;
    let id = HubId {
        repo,
        revision: PARQUET_REVISION.into(),
    };
    let hub = Hub::from_env()?;
    let files: Vec<String> = hub
        .dataset_files(&id)?
        .into_iter()
        // CONFIG/SPLIT/FILE.parquet; names come from the server and become cache paths: no
        // empty, `.` or `..` parts.
        .filter(|f| {
            let parts: Vec<&str> = f.split('/').collect();
            f.ends_with(".parquet")
                && parts.len() == 3
                && parts
                    .iter()
                    .all(|p| !p.is_empty() && *p != "." && *p != "..")
        })
        .collect();
    let mut configs: Vec<&str> = files.iter().filter_map(|f| f.split('/').next()).collect();
    configs.sort_unstable();
    configs.dedup();
    let config = match (config, configs.as_slice()) {
        (Some(c), _) if configs.contains(&c) => c,
        (Some(c), _) => {
            return Err(KilnError::Config(format!(
                "Hub dataset {}: no config {c:?} (configs: {})",
                id.repo,
                configs.join(", ")
            )))
        }
        (None, [only]) => only,
        (None, []) => {
            return Err(KilnError::Config(format!(
                "Hub dataset {} has no Parquet conversion (no CONFIG/SPLIT/*.parquet files at \
                 {PARQUET_REVISION})",
                id.repo
            )))
        }
        (None, many) => {
            return Err(KilnError::Config(format!(
                "Hub dataset {} has several configs ({}): pick one with --dataset-config",
                id.repo,
                many.join(", ")
            )))
        }
    };
    let split_files = |split: &str| -> Vec<&String> {
        let prefix = format!("{config}/{split}/");
        files.iter().filter(|f| f.starts_with(&prefix)).collect()
    };
    let mut splits: Vec<&str> = files
        .iter()
        .filter(|f| f.starts_with(&format!("{config}/")))
        .filter_map(|f| f.split('/').nth(1))
        .collect();
    splits.sort_unstable();
    splits.dedup();
    let fetch = |split: &str| -> Result<PathBuf> {
        let wanted = split_files(split);
        if wanted.is_empty() {
            return Err(KilnError::Config(format!(
                "Hub dataset {} ({config}): no split {split:?} (splits: {})",
                id.repo,
                splits.join(", ")
            )));
        }
        let mut dir = None;
        for f in wanted {
            let local = hub.dataset_file(&id, f)?;
            dir = local.parent().map(Path::to_path_buf);
        }
        Ok(dir.expect("at least one file"))
    };
    let train = if want_train {
        Some(fetch(train_split.unwrap_or("train"))?)
    } else {
        None
    };
    let eval = match eval_split {
        Some(s) => Some(fetch(s)?),
        None => match ["validation", "test"]
            .into_iter()
            .find(|s| splits.contains(s))
        {
            Some(s) => Some(fetch(s)?),
            None => None,
        },
    };
    Ok((train, eval))
}

/// The Hub id of a path inside the Hugging Face cache, as [`resolve`] leaves it
/// (`…/models--org--name/snapshots/<commit>/…` → `org/name`; datasets likewise), for the model
/// card to name where a run started from.
pub fn cached_repo_id(path: &Path) -> Option<String> {
    path.components().find_map(|c| {
        let name = c.as_os_str().to_str()?;
        let rest = name
            .strip_prefix("models--")
            .or_else(|| name.strip_prefix("datasets--"))?;
        Some(rest.replace("--", "/"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_parse_as_the_hub_allows_them() {
        let id = HubId::parse("org/name@v1.0").unwrap();
        assert_eq!(
            (id.repo.as_str(), id.revision.as_str()),
            ("org/name", "v1.0")
        );
        assert_eq!(HubId::parse("bert-base-uncased").unwrap().revision, "main");
        for bad in [
            "./model",
            "/abs/path",
            "a/b/c",
            "a..b",
            "x@",
            "org/-name",
            "a b",
            "",
        ] {
            assert_eq!(HubId::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn cache_paths_name_their_repo() {
        let p = Path::new("/h/hub/models--org--tiny-bert/snapshots/abc/config.json");
        assert_eq!(cached_repo_id(p).as_deref(), Some("org/tiny-bert"));
        let d = Path::new("/h/hub/datasets--tweets/snapshots/1/default/train/0000.parquet");
        assert_eq!(cached_repo_id(d).as_deref(), Some("tweets"));
        assert_eq!(cached_repo_id(Path::new("assets/minilm")), None);
    }
}

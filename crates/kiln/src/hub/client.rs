//! kiln's Hugging Face Hub client over `ureq`: one file at a time into the cache layout Python's
//! `huggingface_hub` uses (`models--org--name/{blobs,snapshots,refs}`, locks in `.locks`), and a
//! repo's file list. It trusts the server with nothing that becomes a path or reaches another host:
//!
//! - commit hashes must be 40 hex digits, ETags plain names, revisions ref names, file names
//!   relative paths without `.`/`..` parts; every cache path is built from those and checked to stay
//!   inside the cache;
//! - `Authorization` goes only to the endpoint's own host (a redirect to a CDN does not carry it);
//! - at most [`MAX_REDIRECTS`] hops, a 3xx without `Location` is an error, never a panic;
//! - connect and read timeouts as `huggingface_hub`'s (`HF_HUB_ETAG_TIMEOUT`,
//!   `HF_HUB_DOWNLOAD_TIMEOUT`, 10 s each);
//! - a download enters the cache only when its size is the announced one and, for an LFS file
//!   (a sha256 ETag), its sha256 is the ETag.
//!
//! Why not the `hf-hub` crate any more: its sync API built cache paths from those headers unchecked
//! (a download written outside the cache), re-sent the token after cross-host redirects, had no
//! timeouts, panicked on a redirect without `Location` and cached short or oversized bodies
//! (issue 31). The part kiln needs is this file.

use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// Redirect hops followed for one request (`requests` allows 30; the Hub uses one or two).
pub const MAX_REDIRECTS: usize = 10;

/// A model or a dataset repository.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepoKind {
    Model,
    Dataset,
}

impl RepoKind {
    fn url_prefix(self) -> &'static str {
        match self {
            Self::Model => "",
            Self::Dataset => "datasets/",
        }
    }
    fn api(self) -> &'static str {
        match self {
            Self::Model => "models",
            Self::Dataset => "datasets",
        }
    }
    fn folder_prefix(self) -> &'static str {
        match self {
            Self::Model => "models--",
            Self::Dataset => "datasets--",
        }
    }
}

/// Why a request gave no file.
#[derive(Debug)]
pub enum Failure {
    /// The server answered with an error status (and its `X-Error-Code`, if any).
    Status { code: u16, error_code: String },
    /// No answer: connection refused, timed out, TLS.
    Transport(String),
    /// The answer was refused: a header or body kiln does not accept, in one sentence.
    Refused(String),
    /// Offline, and the cache does not hold it.
    NotCached,
    /// The cache could not be written.
    Io(String),
}

/// The Hub's address: as given for requests, without credentials for messages.
#[derive(Debug, Clone)]
pub struct Endpoint {
    url: url::Url,
    shown: String,
}

impl Endpoint {
    /// `HF_ENDPOINT`'s value; an error names it without its credentials.
    pub fn parse(s: &str) -> Result<Self, String> {
        let url = url::Url::parse(s.trim().trim_end_matches('/'))
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https") && u.host_str().is_some())
            .ok_or_else(|| {
                format!(
                    "HF_ENDPOINT {:?} is not an http(s) address",
                    strip_credentials(s)
                )
            })?;
        Ok(Self {
            shown: strip_credentials(url.as_str())
                .trim_end_matches('/')
                .to_string(),
            url,
        })
    }

    /// The address without user and password, for messages.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    fn join(&self, path: &str) -> String {
        format!("{}/{path}", self.url.as_str().trim_end_matches('/'))
    }
}

/// `s` with any `user:password@` of a URL in it removed (and left as it is otherwise).
pub fn strip_credentials(s: &str) -> String {
    match url::Url::parse(s) {
        Ok(mut u) if !u.username().is_empty() || u.password().is_some() => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.to_string()
        }
        Ok(_) => s.to_string(),
        // Not a URL: cut a `scheme://user:pass@` by hand.
        Err(_) => match (s.find("://"), s.find('@')) {
            (Some(a), Some(b)) if b > a => format!("{}{}", &s[..a + 3], &s[b + 1..]),
            _ => s.to_string(),
        },
    }
}

/// Settings of a [`Client`].
pub struct ClientConfig {
    pub endpoint: Endpoint,
    pub token: Option<String>,
    pub cache: PathBuf,
    /// Connect/read timeout of metadata requests (`HF_HUB_ETAG_TIMEOUT`).
    pub etag_timeout: Duration,
    /// Connect/read timeout of downloads, per read (`HF_HUB_DOWNLOAD_TIMEOUT`).
    pub download_timeout: Duration,
    /// Show a progress bar while downloading.
    pub progress: bool,
}

pub struct Client {
    cfg: ClientConfig,
    meta: ureq::Agent,
    data: ureq::Agent,
}

/// What the Hub says of a file before it is downloaded.
struct Metadata {
    commit: String,
    etag: String,
    size: u64,
    /// Where the bytes are (a CDN for LFS files), else the resolve URL itself.
    location: String,
}

fn agent(timeout: Duration) -> ureq::Agent {
    ureq::AgentBuilder::new()
        .redirects(0)
        .timeout_connect(timeout)
        .timeout_read(timeout)
        .timeout_write(timeout)
        .try_proxy_from_env(true)
        .user_agent(concat!("kiln/", env!("CARGO_PKG_VERSION")))
        .build()
}

/// A revision kiln puts in a URL and a `refs/` path: a branch, tag or `refs/…` name as git allows
/// it (no empty, `.` or `..` parts, no leading `/`, no control characters or backslashes).
pub fn valid_revision(rev: &str) -> bool {
    !rev.is_empty()
        && rev.len() <= 255
        && !rev.starts_with('/')
        && !rev.ends_with('/')
        && !rev.contains('\\')
        && !rev.chars().any(char::is_control)
        && rev
            .split('/')
            .all(|p| !p.is_empty() && p != "." && p != "..")
}

/// A commit hash as the Hub gives it (and as `huggingface_hub` requires): 40 hex digits.
pub fn valid_commit(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A file name inside a repo: a relative path whose parts are plain names.
pub fn valid_file_name(f: &str) -> bool {
    !f.is_empty()
        && f.len() <= 1024
        && !f.contains('\\')
        && !f.chars().any(char::is_control)
        && f.split('/').all(|p| !p.is_empty() && p != "." && p != "..")
        && Path::new(f)
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
}

/// An ETag as a blob's file name: quotes and a weak `W/` prefix removed, then letters, digits,
/// `-` and `_` only (the Hub's are hex: git SHA-1 or LFS SHA-256).
fn normalize_etag(raw: &str) -> Option<String> {
    let e = raw.trim().trim_start_matches("W/").trim_matches('"');
    (!e.is_empty()
        && e.len() <= 128
        && e.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b)))
    .then(|| e.to_string())
}

/// `path` is inside `root` (lexically: no `..`, built from checked parts).
fn inside(root: &Path, path: &Path) -> bool {
    path.strip_prefix(root)
        .is_ok_and(|rest| rest.components().all(|c| matches!(c, Component::Normal(_))))
}

impl Client {
    pub fn new(cfg: ClientConfig) -> Self {
        let (meta, data) = (agent(cfg.etag_timeout), agent(cfg.download_timeout));
        Self { cfg, meta, data }
    }

    pub fn cache(&self) -> &Path {
        &self.cfg.cache
    }

    pub fn endpoint(&self) -> &Endpoint {
        &self.cfg.endpoint
    }

    /// The repo's folder in the cache (`models--org--name`); `repo` is a checked Hub id.
    pub fn repo_folder(&self, kind: RepoKind, repo: &str) -> PathBuf {
        self.cfg.cache.join(format!(
            "{}{}",
            kind.folder_prefix(),
            repo.replace('/', "--")
        ))
    }

    /// Whether the request to `url` may carry the token: only to the endpoint's own scheme, host
    /// and port (`requests` drops it when the host changes).
    fn same_origin(&self, url: &url::Url) -> bool {
        let e = &self.cfg.endpoint.url;
        url.scheme() == e.scheme()
            && url.host_str() == e.host_str()
            && url.port_or_known_default() == e.port_or_known_default()
    }

    /// One request, following redirects: every one when `all`, else only relative ones (an absolute
    /// one — the Hub's redirect of an LFS file to its CDN — is returned as it is).
    fn send(
        &self,
        agent: &ureq::Agent,
        method: &str,
        url: &str,
        all: bool,
    ) -> Result<ureq::Response, Failure> {
        let mut url = url::Url::parse(url).map_err(|e| Failure::Refused(format!("{e}")))?;
        for _ in 0..=MAX_REDIRECTS {
            let mut req = agent
                .request(method, url.as_str())
                .set("Accept-Encoding", "identity");
            if let (Some(t), true) = (&self.cfg.token, self.same_origin(&url)) {
                req = req.set("Authorization", &format!("Bearer {t}"));
            }
            let resp = match req.call() {
                Ok(r) => r,
                Err(ureq::Error::Status(code, r)) => {
                    return Err(Failure::Status {
                        code,
                        error_code: r.header("X-Error-Code").unwrap_or("").to_string(),
                    })
                }
                Err(ureq::Error::Transport(t)) => {
                    return Err(Failure::Transport(strip_credentials(&t.to_string())))
                }
            };
            if !(300..400).contains(&resp.status()) {
                return Ok(resp);
            }
            let Some(location) = resp.header("Location") else {
                return Err(Failure::Refused(format!(
                    "HTTP {} without a Location to go to",
                    resp.status()
                )));
            };
            let relative = url::Url::parse(location).is_err();
            if !relative && !all {
                return Ok(resp);
            }
            url = url
                .join(location)
                .map_err(|e| Failure::Refused(format!("a redirect to {location:?} ({e})")))?;
            if !matches!(url.scheme(), "http" | "https") {
                return Err(Failure::Refused(format!(
                    "a redirect to a {} address",
                    url.scheme()
                )));
            }
        }
        Err(Failure::Refused(format!(
            "more than {MAX_REDIRECTS} redirects"
        )))
    }

    fn resolve_url(&self, kind: RepoKind, repo: &str, revision: &str, file: &str) -> String {
        let quote = |s: &str| {
            url::form_urlencoded::byte_serialize(s.as_bytes())
                .collect::<String>()
                .replace('+', "%20")
        };
        let file: Vec<String> = file.split('/').map(quote).collect();
        self.cfg.endpoint.join(&format!(
            "{}{repo}/resolve/{}/{}",
            kind.url_prefix(),
            quote(revision),
            file.join("/")
        ))
    }

    /// The commit, ETag, size and location of `file`, from a HEAD request (relative redirects
    /// followed, as `huggingface_hub` does).
    fn metadata(&self, url: &str) -> Result<Metadata, Failure> {
        let resp = self.send(&self.meta, "HEAD", url, false)?;
        let h = |name: &str| resp.header(name).map(str::trim).filter(|v| !v.is_empty());
        let commit =
            h("X-Repo-Commit").ok_or_else(|| Failure::Refused("no X-Repo-Commit header".into()))?;
        if !valid_commit(commit) {
            return Err(Failure::Refused(format!(
                "X-Repo-Commit {commit:?} is not a commit hash (40 hex digits)"
            )));
        }
        let raw_etag = h("X-Linked-Etag")
            .or_else(|| h("ETag"))
            .ok_or_else(|| Failure::Refused("no ETag header".into()))?;
        let etag = normalize_etag(raw_etag)
            .ok_or_else(|| Failure::Refused(format!("ETag {raw_etag:?} is not a plain name")))?;
        let size = h("X-Linked-Size")
            .or_else(|| h("Content-Length"))
            .ok_or_else(|| Failure::Refused("no size (X-Linked-Size or Content-Length)".into()))?;
        let size = size
            .parse::<u64>()
            .map_err(|_| Failure::Refused(format!("size {size:?} is not a number")))?;
        let location = if (300..400).contains(&resp.status()) {
            let to = resp.header("Location").unwrap_or_default();
            url::Url::parse(url)
                .and_then(|u| u.join(to))
                .map(String::from)
                .map_err(|e| Failure::Refused(format!("a redirect to {to:?} ({e})")))?
        } else {
            url.to_string()
        };
        Ok(Metadata {
            commit: commit.to_ascii_lowercase(),
            etag,
            size,
            location,
        })
    }

    /// The cached path of `file` at `revision` in repo `repo`: downloaded unless the snapshot
    /// already has it; from the cache alone when `offline`.
    pub fn file(
        &self,
        kind: RepoKind,
        repo: &str,
        revision: &str,
        file: &str,
        offline: bool,
    ) -> Result<PathBuf, Failure> {
        if !valid_revision(revision) {
            return Err(Failure::Refused(format!(
                "revision {revision:?} is not a branch, tag or commit name"
            )));
        }
        if !valid_file_name(file) {
            return Err(Failure::Refused(format!(
                "file name {file:?} is not a relative path of plain names"
            )));
        }
        let folder = self.repo_folder(kind, repo);
        if offline || valid_commit(revision) {
            if let Some(p) = self.cached(&folder, revision, file) {
                return Ok(p);
            }
            if offline {
                return Err(Failure::NotCached);
            }
        }
        let url = self.resolve_url(kind, repo, revision, file);
        let meta = match self.metadata(&url) {
            Ok(m) => m,
            // No answer: a file cached before still serves (as huggingface_hub falls back).
            Err(Failure::Transport(t)) => {
                return self
                    .cached(&folder, revision, file)
                    .ok_or(Failure::Transport(t))
            }
            Err(e) => return Err(e),
        };
        let snapshot = folder.join("snapshots").join(&meta.commit);
        let pointer = snapshot.join(file);
        let blob = folder.join("blobs").join(&meta.etag);
        for p in [&pointer, &blob] {
            if !inside(&self.cfg.cache, p) {
                return Err(Failure::Refused(format!(
                    "{} is outside the cache",
                    p.display()
                )));
            }
        }
        if revision != meta.commit {
            self.write_ref(&folder, revision, &meta.commit)?;
        }
        if !pointer.exists() {
            if !blob.is_file() {
                self.download(&folder, &meta, &blob, file)?;
            }
            link(&blob, &pointer)
                .map_err(|e| Failure::Io(format!("{}: {e}", pointer.display())))?;
        }
        Ok(pointer)
    }

    /// `file` in the snapshot `revision` names (a commit, or a ref the cache recorded).
    fn cached(&self, folder: &Path, revision: &str, file: &str) -> Option<PathBuf> {
        let commit = if valid_commit(revision) {
            revision.to_ascii_lowercase()
        } else {
            let r = std::fs::read_to_string(folder.join("refs").join(revision)).ok()?;
            let r = r.trim().to_string();
            valid_commit(&r).then_some(r)?
        };
        let p = folder.join("snapshots").join(commit).join(file);
        p.is_file().then_some(p)
    }

    /// `refs/<revision>` ← `commit`, through a temporary file and a rename.
    fn write_ref(&self, folder: &Path, revision: &str, commit: &str) -> Result<(), Failure> {
        let path = folder.join("refs").join(revision);
        if std::fs::read_to_string(&path).is_ok_and(|c| c.trim() == commit) {
            return Ok(());
        }
        let io = |e: std::io::Error| Failure::Io(format!("{}: {e}", path.display()));
        std::fs::create_dir_all(path.parent().expect("refs/ is above")).map_err(io)?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, commit).map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)
    }

    /// The blob's bytes from `meta.location` into `blob`: under a lock that other kiln and
    /// `huggingface_hub` processes take too, into `<blob>.incomplete`, moved in place once the size
    /// (and for a SHA-256 ETag, the hash) is right.
    fn download(
        &self,
        folder: &Path,
        meta: &Metadata,
        blob: &Path,
        file: &str,
    ) -> Result<(), Failure> {
        let io = |p: &Path, e: std::io::Error| Failure::Io(format!("{}: {e}", p.display()));
        let locks = self
            .cfg
            .cache
            .join(".locks")
            .join(folder.file_name().expect("a repo folder has a name"));
        std::fs::create_dir_all(&locks).map_err(|e| io(&locks, e))?;
        std::fs::create_dir_all(blob.parent().expect("blobs/")).map_err(|e| io(blob, e))?;
        let lock_path = locks.join(format!("{}.lock", meta.etag));
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| io(&lock_path, e))?;
        lock.lock().map_err(|e| io(&lock_path, e))?;
        if blob.is_file() {
            // Another process finished it while this one waited.
            return Ok(());
        }
        let partial = blob.with_extension("incomplete");
        let result = self.fetch_into(meta, &partial, file);
        if let Err(e) = result {
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
        std::fs::rename(&partial, blob).map_err(|e| io(blob, e))
    }

    fn fetch_into(&self, meta: &Metadata, partial: &Path, file: &str) -> Result<(), Failure> {
        let resp = self.send(&self.data, "GET", &meta.location, true)?;
        let mut out = std::fs::File::create(partial)
            .map_err(|e| Failure::Io(format!("{}: {e}", partial.display())))?;
        let bar = self.cfg.progress.then(|| {
            let b = indicatif::ProgressBar::new(meta.size);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "{msg} {bar:30} {bytes}/{total_bytes} {bytes_per_sec} {eta}",
                )
                .expect("a valid template"),
            );
            b.set_message(crate::error::escape_for_terminal(file));
            b
        });
        let started = Instant::now();
        let mut sha = Sha256::new();
        let mut got = 0u64;
        // Read one byte past the announced size, to tell a longer body from a complete one.
        let mut body = resp.into_reader().take(meta.size + 1);
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = body.read(&mut buf).map_err(|e| {
                Failure::Transport(format!("reading {file} after {got} bytes: {e}"))
            })?;
            if n == 0 {
                break;
            }
            got += n as u64;
            sha.update(&buf[..n]);
            out.write_all(&buf[..n])
                .map_err(|e| Failure::Io(format!("{}: {e}", partial.display())))?;
            if let Some(b) = &bar {
                b.set_position(got);
            }
        }
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        if got != meta.size {
            return Err(Failure::Refused(format!(
                "{file}: the body has {}{got} bytes where {} were announced",
                if got > meta.size { "more than " } else { "" },
                meta.size
            )));
        }
        if meta.etag.len() == 64 && meta.etag.bytes().all(|b| b.is_ascii_hexdigit()) {
            let hash: String = sha.finalize().iter().map(|b| format!("{b:02x}")).collect();
            if !hash.eq_ignore_ascii_case(&meta.etag) {
                return Err(Failure::Refused(format!(
                    "{file}: its SHA-256 is {hash}, not the {} its ETag announced",
                    meta.etag
                )));
            }
        }
        out.sync_all()
            .map_err(|e| Failure::Io(format!("{}: {e}", partial.display())))?;
        tracing::debug!(
            "{file}: {got} bytes in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// The files of repo `repo` at `revision`, as the Hub lists them (names checked by the caller
    /// before any becomes a path).
    pub fn list_files(
        &self,
        kind: RepoKind,
        repo: &str,
        revision: &str,
    ) -> Result<Vec<String>, Failure> {
        if !valid_revision(revision) {
            return Err(Failure::Refused(format!(
                "revision {revision:?} is not a branch, tag or commit name"
            )));
        }
        let rev = url::form_urlencoded::byte_serialize(revision.as_bytes()).collect::<String>();
        let url = self
            .cfg
            .endpoint
            .join(&format!("api/{}/{repo}/revision/{rev}", kind.api()));
        let resp = self.send(&self.meta, "GET", &url, true)?;
        // A file list is small: 64 MiB is far beyond any real one.
        let mut body = Vec::new();
        resp.into_reader()
            .take(64 << 20)
            .read_to_end(&mut body)
            .map_err(|e| Failure::Transport(format!("reading the file list: {e}")))?;
        let v: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| Failure::Refused(format!("the file list is not JSON ({e})")))?;
        let siblings = v["siblings"]
            .as_array()
            .ok_or_else(|| Failure::Refused("the file list has no \"siblings\" array".into()))?;
        Ok(siblings
            .iter()
            .filter_map(|s| s["rfilename"].as_str().map(str::to_string))
            .collect())
    }
}

/// `pointer` → `blob` as a relative symbolic link (what `huggingface_hub` makes), else a copy.
fn link(blob: &Path, pointer: &Path) -> std::io::Result<()> {
    let dir = pointer.parent().expect("a snapshot file has a folder");
    std::fs::create_dir_all(dir)?;
    // snapshots/<commit>/a/b/file → ../../../../blobs/<etag>: one `..` per folder below the repo.
    let repo = blob
        .parent()
        .and_then(Path::parent)
        .expect("blobs/ is inside the repo folder");
    let depth = dir
        .strip_prefix(repo)
        .map(|p| p.components().count())
        .unwrap_or(0);
    let mut target = PathBuf::new();
    for _ in 0..depth {
        target.push("..");
    }
    target.push("blobs");
    target.push(blob.file_name().expect("a blob has a name"));
    let tmp = pointer.with_extension(format!("link{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    #[cfg(unix)]
    let made = std::os::unix::fs::symlink(&target, &tmp);
    #[cfg(not(unix))]
    let made = std::fs::copy(blob, &tmp).map(drop);
    made?;
    std::fs::rename(&tmp, pointer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_from_the_server_are_checked_before_they_become_paths() {
        for ok in [
            "main",
            "v1.0",
            "refs/convert/parquet",
            "refs/pr/1",
            &"a".repeat(40),
        ] {
            assert!(valid_revision(ok), "{ok}");
        }
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../b",
            "a//b",
            "a/",
            "a\\b",
            "a\nb",
            ".",
        ] {
            assert!(!valid_revision(bad), "{bad:?}");
        }
        assert!(valid_commit(&"0123456789abcdef".repeat(3)[..40]));
        for bad in ["../..", "abc", &"g".repeat(40), &"a".repeat(41)] {
            assert!(!valid_commit(bad), "{bad}");
        }
        for ok in ["config.json", "default/train/0000.parquet", "a b.txt"] {
            assert!(valid_file_name(ok), "{ok}");
        }
        for bad in ["", "/abs", "../x", "a/./b", "a//b", "a\0b", "a\\..\\b"] {
            assert!(!valid_file_name(bad), "{bad:?}");
        }
        assert_eq!(normalize_etag("W/\"abc123\"").as_deref(), Some("abc123"));
        for bad in ["\"../..\"", "/tmp/x", "\"a/b\"", "\"\"", "a.b"] {
            assert_eq!(normalize_etag(bad), None, "{bad}");
        }
    }

    #[test]
    fn credentials_never_reach_a_message() {
        assert_eq!(
            strip_credentials("http://user:secret@hub.local:8080/x"),
            "http://hub.local:8080/x"
        );
        assert_eq!(
            strip_credentials("https://huggingface.co"),
            "https://huggingface.co"
        );
        assert_eq!(strip_credentials("weird://u:p@h"), "weird://h");
        let e = Endpoint::parse("http://user:secret@127.0.0.1:9/").unwrap();
        assert_eq!(e.shown(), "http://127.0.0.1:9");
        let bad = Endpoint::parse("ftp://user:secret@h").unwrap_err();
        assert!(!bad.contains("secret"), "{bad}");
    }

    #[test]
    fn snapshot_links_point_into_blobs() {
        let tmp = tempfile::tempdir().unwrap();
        let repo = tmp.path().join("models--a--b");
        let blob = repo.join("blobs/e1");
        std::fs::create_dir_all(blob.parent().unwrap()).unwrap();
        std::fs::write(&blob, b"x").unwrap();
        let pointer = repo.join("snapshots/c/sub/dir/f.json");
        link(&blob, &pointer).unwrap();
        assert_eq!(std::fs::read(&pointer).unwrap(), b"x");
        #[cfg(unix)]
        assert_eq!(
            std::fs::read_link(&pointer).unwrap(),
            Path::new("../../../../blobs/e1")
        );
    }
}

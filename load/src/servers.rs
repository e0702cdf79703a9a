//! The servers a benchmark starts: the sidecar binary built beside this one (or another program
//! that says where it listens on its first line), each killed when its handle drops.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// A server process, killed when dropped.
pub(crate) struct Server {
    child: Child,
    pub(crate) base: String,
}

impl Server {
    pub(crate) async fn start(program: &Path, args: &[&str]) -> anyhow::Result<Server> {
        let mut child = Command::new(program)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {}: {e}", program.display()))?;
        let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await??.unwrap_or_default();
        let address = line
            .split("http://")
            .nth(1)
            .and_then(|a| a.split_whitespace().next())
            .ok_or_else(|| anyhow::anyhow!("{} did not say where it listens: {line:?}", program.display()))?;
        Ok(Server { child, base: format!("http://{address}") })
    }

    /// Its resident set (Linux's `VmRSS`), where the kernel says.
    pub(crate) fn resident_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()?)).ok()?;
        let kb: u64 =
            status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kb * 1024)
    }
}

fn sidecar_binary() -> anyhow::Result<PathBuf> {
    let here = std::env::current_exe()?;
    let path = here.with_file_name("ferry-sidecar");
    anyhow::ensure!(
        path.exists(),
        "{} is missing: build it with `cargo build --release -p ferry-sidecar`",
        path.display()
    );
    Ok(path)
}

/// The sidecar, once its model is ready: a model the llm engine loads is not ready until it has
/// loaded (in the background, the sidecar live meanwhile).
pub(crate) async fn sidecar(args: &[&str]) -> anyhow::Result<Server> {
    let mut all = vec!["--model", "m", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"];
    all.extend_from_slice(args);
    let mut server = Server::start(&sidecar_binary()?, &all).await?;
    let ready = format!("{}/v2/health/ready", server.base);
    let client = reqwest::Client::new();
    let started = ferry_core::clock::now();
    while !client.get(&ready).send().await.is_ok_and(|r| r.status().is_success()) {
        if let Some(status) = server.child.try_wait()? {
            anyhow::bail!("the sidecar exited before it was ready ({status}): its model did not load");
        }
        anyhow::ensure!(
            ferry_core::clock::elapsed(started) < Duration::from_secs(300),
            "the sidecar was not ready within 300 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(server)
}

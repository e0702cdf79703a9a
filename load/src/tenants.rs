//! `--tenants`: callers to play, from the sidecar's own tenants file (only `name` and `token` are
//! read; the quotas are the server's business), each sending its share of the requests with its
//! own bearer token, so that the report can say what each got.

use std::path::Path;

use rand::Rng;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
struct File {
    tenants: Vec<Entry>,
}

#[derive(Debug, Deserialize)]
struct Entry {
    name: String,
    token: String,
}

/// One caller of the run.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadTenant {
    pub name: String,
    pub token: String,
    /// Its share of the requests (relative to the others').
    pub share: f64,
}

/// Reads `path`, with `shares` (`name=share,...`; a tenant not named gets 1).
pub fn load(path: &Path, shares: Option<&str>) -> anyhow::Result<Vec<LoadTenant>> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("--tenants {}: {e}", path.display()))?;
    let file: File = serde_saphyr::from_str(&text).map_err(|e| anyhow::anyhow!("--tenants {}: {e}", path.display()))?;
    anyhow::ensure!(!file.tenants.is_empty(), "--tenants {}: the file names no tenant", path.display());
    let mut tenants: Vec<LoadTenant> =
        file.tenants.into_iter().map(|e| LoadTenant { name: e.name, token: e.token, share: 1.0 }).collect();
    for part in shares.into_iter().flat_map(|s| s.split(',')).filter(|p| !p.is_empty()) {
        let (name, share) =
            part.split_once('=').ok_or_else(|| anyhow::anyhow!("--tenant-shares: '{part}' must be NAME=SHARE"))?;
        let share: f64 =
            share.parse().map_err(|_| anyhow::anyhow!("--tenant-shares: '{share}' of '{name}' is not a number"))?;
        anyhow::ensure!(share.is_finite() && share >= 0.0, "--tenant-shares: {name}={share}; a share is 0 or more");
        let t = tenants
            .iter_mut()
            .find(|t| t.name == name)
            .ok_or_else(|| anyhow::anyhow!("--tenant-shares: '{name}' is not a tenant of {}", path.display()))?;
        t.share = share;
    }
    anyhow::ensure!(tenants.iter().any(|t| t.share > 0.0), "--tenant-shares: every share is 0");
    Ok(tenants)
}

/// Which tenant sends the next request: drawn by share.
pub fn pick(tenants: &[LoadTenant], rng: &mut impl Rng) -> usize {
    let total: f64 = tenants.iter().map(|t| t.share).sum();
    let mut x = rng.random::<f64>() * total;
    for (i, t) in tenants.iter().enumerate() {
        if x < t.share {
            return i;
        }
        x -= t.share;
    }
    tenants.iter().rposition(|t| t.share > 0.0).expect("a positive share")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn shares_split_the_requests_and_name_what_is_wrong() {
        let dir = tempfile_dir();
        let path = dir.join("t.yaml");
        std::fs::write(&path, "tenants:\n  - {name: heavy, token: heavy-token, weight: 1, rate: 5}\n  - {name: light, token: light-token}\n").unwrap();
        let tenants = load(&path, Some("heavy=9")).unwrap();
        assert_eq!(tenants[0], LoadTenant { name: "heavy".into(), token: "heavy-token".into(), share: 9.0 });
        let mut rng = StdRng::seed_from_u64(1);
        let heavy = (0..10_000).filter(|_| pick(&tenants, &mut rng) == 0).count();
        assert!((8800..=9200).contains(&heavy), "{heavy} of 10000");
        assert!(load(&path, Some("nobody=1")).unwrap_err().to_string().contains("'nobody' is not a tenant"));
        assert!(load(&path, Some("heavy")).unwrap_err().to_string().contains("NAME=SHARE"));
        assert!(load(&path, Some("heavy=0,light=0")).unwrap_err().to_string().contains("every share is 0"));
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("ferry-load-tenants-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}

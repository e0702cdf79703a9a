//! Every Kubernetes API call the operator makes, as RBAC rules: the one list that the Helm chart's
//! ClusterRole and Role must equal (a chart test compares them), and that the scripted-API tests
//! check each request they see against (so the list cannot miss a call).

use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rule {
    #[serde(rename = "apiGroup")]
    pub api_group: &'static str,
    pub resource: &'static str,
    pub verbs: &'static [&'static str],
    /// Why the operator needs it.
    #[serde(skip)]
    pub why: &'static str,
}

/// Rules across namespaces (a ClusterRole): the operator serves InferenceServices everywhere.
pub const CLUSTER_RULES: &[Rule] = &[
    Rule {
        api_group: "ferry.dev",
        resource: "inferenceservices",
        verbs: &["list", "watch"],
        why: "the controller watches InferenceServices",
    },
    Rule {
        api_group: "ferry.dev",
        resource: "inferenceservices/status",
        verbs: &["patch"],
        why: "the reconciler patches the status",
    },
    Rule {
        api_group: "apps",
        resource: "deployments",
        verbs: &["get", "list", "watch", "create", "patch"],
        why: "worker Deployments: read, watched as owned objects, server-side applied (apply creates)",
    },
    Rule {
        api_group: "",
        resource: "services",
        verbs: &["list", "watch", "create", "patch"],
        why: "worker Services: watched as owned objects, server-side applied (apply creates)",
    },
    Rule {
        api_group: "",
        resource: "pods",
        verbs: &["list", "watch", "patch"],
        why: "the autoscaler watches the worker pods to scrape (and the holder's), and sets their deletion cost before a scale-down",
    },
    Rule {
        api_group: "discovery.k8s.io",
        resource: "endpointslices",
        verbs: &["create", "patch", "delete"],
        why: "a service that scales to zero: its EndpointSlice of holder pods, server-side applied, deleted when it stops",
    },
    Rule {
        api_group: "events.k8s.io",
        resource: "events",
        verbs: &["create", "patch"],
        why: "events about InferenceServices (a repeated event is patched into a series)",
    },
];

/// Rules the ClusterRole adds where the chart lets services be routed (`routing.inferencePools`):
/// the InferencePools of services with `spec.routing.inferencePool`, server-side applied, and
/// deleted when a service stops asking for one (deleting the service deletes its pool through
/// its owner reference).
pub const ROUTING_RULES: &[Rule] = &[Rule {
    api_group: "inference.networking.k8s.io",
    resource: "inferencepools",
    verbs: &["list", "watch", "create", "patch", "delete"],
    why: "InferencePools of routed services: watched as owned objects, server-side applied, deleted when routing is turned off",
}];

/// Rules in the operator's own namespace (a Role): leader election.
pub const NAMESPACE_RULES: &[Rule] = &[Rule {
    api_group: "coordination.k8s.io",
    resource: "leases",
    verbs: &["get", "create", "update"],
    why: "leader election on one Lease",
}];

/// The RBAC verb and (group, resource[/subresource]) of an API request, from its method and
/// path, as the API server's authorizer sees it.
pub fn attributes(method: &str, path: &str, query: &str) -> Option<(String, String, &'static str)> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match parts.as_slice() {
        ["api", "v1", rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => return None,
    };
    let rest = match rest {
        ["namespaces", _ns, rest @ ..] => rest,
        rest => rest,
    };
    let (resource, named) = match rest {
        [resource] => (resource.to_string(), false),
        [resource, _name] => (resource.to_string(), true),
        [resource, _name, sub] => (format!("{resource}/{sub}"), true),
        _ => return None,
    };
    let verb = match (method, named) {
        ("GET", true) => "get",
        ("GET", false) if query.split('&').any(|q| q == "watch=true") => "watch",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", _) => "delete",
        _ => return None,
    };
    Some((group.to_owned(), resource, verb))
}

/// Whether the rules grant a request.
pub fn allows(method: &str, path: &str, query: &str) -> bool {
    let Some((group, resource, verb)) = attributes(method, path, query) else { return false };
    CLUSTER_RULES
        .iter()
        .chain(ROUTING_RULES)
        .chain(NAMESPACE_RULES)
        .any(|r| r.api_group == group && r.resource == resource && r.verbs.contains(&verb))
}

/// The rules as JSON, for `ferry-operator rbac` (the chart test reads it).
pub fn to_json() -> serde_json::Value {
    serde_json::json!({
        "clusterRules": CLUSTER_RULES,
        "routingRules": ROUTING_RULES,
        "namespaceRules": NAMESPACE_RULES,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_map_to_their_rbac_attributes() {
        let a = |m, p, q| attributes(m, p, q).map(|(g, r, v)| format!("{g}|{r}|{v}"));
        assert_eq!(a("GET", "/apis/apps/v1/namespaces/ml/deployments/x", ""), Some("apps|deployments|get".into()));
        assert_eq!(a("GET", "/apis/apps/v1/deployments", "watch=true&rv=1"), Some("apps|deployments|watch".into()));
        assert_eq!(a("GET", "/api/v1/services", ""), Some("|services|list".into()));
        assert_eq!(
            a("PATCH", "/apis/ferry.dev/v1alpha1/namespaces/ml/inferenceservices/x/status", ""),
            Some("ferry.dev|inferenceservices/status|patch".into())
        );
        assert!(
            !allows("DELETE", "/apis/apps/v1/namespaces/ml/deployments/x", ""),
            "the operator never deletes workers"
        );
        assert!(allows("DELETE", "/apis/inference.networking.k8s.io/v1/namespaces/ml/inferencepools/x", ""));
        assert!(!allows("GET", "/api/v1/namespaces/ml/secrets/x", ""), "nor reads secrets");
    }
}

//! Validate: the deployment and what it names, checked before planning
//! (pure). A failure says why, in a reason and a message a person can act on.

use kube::ResourceExt;
use shardplane_crds::validation::Validate;
use shardplane_crds::*;
use shardplane_placement as placement;

use super::cluster_view::{footprint, pool_prompt_step};
use super::observe::Observed;

/// Why a deployment cannot be planned: a reason and what to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocked {
    /// CamelCase reason (the conditions' and the event's).
    pub reason: &'static str,
    /// What is wrong and what to do.
    pub message: String,
}

/// The inputs of planning, once checked.
pub struct Valid<'a> {
    /// The Model.
    pub model: &'a Model,
    /// The NodePool.
    pub pool: &'a NodePool,
    /// The ShardingStrategy.
    pub strategy: &'a ShardingStrategy,
    /// The model's size, as the planner sees it.
    pub footprint: placement::Footprint,
}

/// Checks the deployment and what it names.
pub fn validate<'a>(d: &ModelDeployment, o: &'a Observed) -> Result<Valid<'a>, Blocked> {
    let invalid = |message: String| Blocked {
        reason: "InvalidSpec",
        message,
    };
    d.validate().map_err(|e| invalid(e.to_string()))?;
    let model = o.model.as_deref().ok_or_else(|| Blocked {
        reason: "ModelNotFound",
        message: format!(
            "Model {:?} does not exist in this namespace: create it or fix spec.model",
            d.spec.model
        ),
    })?;
    let pool = o.pool.as_deref().ok_or_else(|| Blocked {
        reason: "NodePoolNotFound",
        message: format!(
            "NodePool {:?} does not exist: create it or fix spec.nodePool",
            d.spec.node_pool
        ),
    })?;
    let strategy = o.strategy.as_deref().ok_or_else(|| Blocked {
        reason: "StrategyNotFound",
        message: format!(
            "ShardingStrategy {:?} does not exist: create it or fix spec.strategy",
            d.spec.strategy
        ),
    })?;
    pool.validate()
        .map_err(|e| invalid(format!("NodePool {}: {e}", pool.name_any())))?;
    strategy
        .validate()
        .map_err(|e| invalid(format!("ShardingStrategy {}: {e}", strategy.name_any())))?;
    d.validate_binding(pool, strategy).map_err(|e| Blocked {
        reason: "StrategyDoesNotFitTier",
        message: e.to_string(),
    })?;
    let step = pool_prompt_step(pool, &o.nodes);
    let footprint = model
        .status
        .as_ref()
        .and_then(|s| footprint(s, step))
        .ok_or_else(|| Blocked {
            reason: "ModelNotResolved",
            message: format!(
                "Model {:?} is not resolved yet: {}",
                d.spec.model,
                model
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.iter().find(|c| c.type_ == CONDITION_RESOLVED))
                    .map_or(
                        "waiting for the operator to read its weights".to_string(),
                        |c| c.message.clone()
                    )
            ),
        })?;
    Ok(Valid {
        model,
        pool,
        strategy,
        footprint,
    })
}

/// The names `d` claims that a deployment of another namespace owns, each
/// with its owner (`shardplane_crds::names`). Not a reason to stop placing
/// it: the deployment serves under its other names, and the gateway never
/// routes a name to it that another namespace owns.
pub fn name_conflicts(d: &ModelDeployment, o: &Observed) -> Vec<(String, String)> {
    let mine = names::claims(d, o.model.as_deref().map(Model::served_name));
    let all: Vec<(&ModelDeployment, Vec<String>)> = o
        .claims
        .iter()
        .map(|(other, names)| (other.as_ref(), names.clone()))
        .collect();
    names::conflicts(d, &mine, &all)
}

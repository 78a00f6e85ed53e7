-- Argo CD health of a BrokerConnection, from the operator's Ready condition.
hs = { status = "Progressing", message = "Waiting for the operator to report Ready" }
if obj.metadata ~= nil and obj.metadata.deletionTimestamp ~= nil then
  -- The operator removes its finalizer once the forwarders are gone and their MQTT sessions
  -- ended; until then the deletion waits.
  hs.message = "Being deleted: waiting for the operator to end the forwarders' MQTT sessions"
  return hs
end
if obj.status == nil then
  return hs
end
if obj.status.observedGeneration ~= nil and obj.metadata.generation ~= nil
    and obj.status.observedGeneration < obj.metadata.generation then
  hs.message = "Waiting for the operator to observe generation " .. obj.metadata.generation
  return hs
end
if obj.status.conditions ~= nil then
  for _, c in ipairs(obj.status.conditions) do
    if c.type == "Ready" then
      hs.message = c.message or c.reason or ""
      if c.status == "True" or c.reason == "NoRules" then
        hs.status = "Healthy"
      elseif c.reason == "ScaledToZero" then
        -- Every group at 0 pods on purpose (replicas 0, or its rules paused).
        hs.status = "Suspended"
      elseif c.reason == "ForwardersNotReady" then
        hs.status = "Progressing"
      elseif c.status == "False" then
        hs.status = "Degraded"
      end
      return hs
    end
  end
end
return hs

-- Argo CD health of a ForwardingRule, from the operator's Ready condition.
hs = { status = "Progressing", message = "Waiting for the operator to report Ready" }
if obj.metadata ~= nil and obj.metadata.deletionTimestamp ~= nil then
  hs.message = "Being deleted"
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
  -- Why a rule is not rendered is in its Accepted condition.
  local accepted = ""
  for _, c in ipairs(obj.status.conditions) do
    if c.type == "Accepted" then
      accepted = (c.reason or "") .. ": " .. (c.message or "")
    end
  end
  for _, c in ipairs(obj.status.conditions) do
    if c.type == "Ready" then
      hs.message = c.message or c.reason or ""
      if c.reason == "NotAccepted" then
        hs.message = accepted
      end
      if c.status == "True" then
        hs.status = "Healthy"
      elseif c.reason == "Paused" or c.reason == "ScaledToZero" then
        -- Stopped on purpose (spec.paused, or the connection's replicas at 0).
        hs.status = "Suspended"
      elseif c.reason == "ForwarderNotReady" or c.reason == "Subscribing" then
        -- Pods starting or rolling out, or loading and subscribing the rule's filters.
        hs.status = "Progressing"
      elseif c.status == "False" then
        hs.status = "Degraded"
      end
      return hs
    end
  end
end
return hs

// Validates custom resources against the JSON schemas that @kubernetes-models generates from prometheus-operator's
// and KEDA's Go API types (the same types their CRDs' openAPIV3Schema is generated from).
//   node validate.mjs < objects.json     (a JSON array of objects; prints one line of JSON per object)
// Exit 0 when every object is valid, 1 when one is not, 2 for a kind it has no schema for.
import { readFileSync } from "node:fs";
import { PrometheusRule, ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1";

const models = {
  "monitoring.coreos.com/v1/PrometheusRule": PrometheusRule,
  "monitoring.coreos.com/v1/ServiceMonitor": ServiceMonitor,
  "keda.sh/v1alpha1/ScaledObject": ScaledObject,
};
let code = 0;
for (const obj of JSON.parse(readFileSync(0, "utf8"))) {
  const key = `${obj.apiVersion}/${obj.kind}`;
  const Model = models[key];
  if (!Model) {
    console.log(JSON.stringify({ kind: key, name: obj.metadata?.name, error: "no schema for this kind" }));
    code = Math.max(code, 2);
    continue;
  }
  try {
    new Model(obj).validate();
    console.log(JSON.stringify({ kind: key, name: obj.metadata?.name, valid: true }));
  } catch (e) {
    console.log(JSON.stringify({ kind: key, name: obj.metadata?.name, valid: false, error: String(e.message) }));
    code = Math.max(code, 1);
  }
}
process.exit(code);

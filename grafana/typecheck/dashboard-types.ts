// The types grafana/pagekeeper.json is checked against (tests/alerts/test_dashboard.py generates
// `const dashboard: PagekeeperDashboard = <the JSON>;` next to this file and runs `tsc --noEmit --strict`).
//
// Everything comes from Grafana's own schema package (@grafana/schema): the classic dashboard model (`Dashboard`,
// `Panel`, `RowPanel`, `VariableModel`, `AnnotationQuery`, `FieldConfig`), and each panel plugin's options and
// field config (timeseries, stat, gauge). Two adjustments, both forced by how the schema is written:
//   - JSON spells enums by value ("absolute"), while the schema types them as TypeScript string enums
//     (ThresholdsMode.Absolute), to which a string literal is not assignable. Json<T> turns every string enum
//     into the union of its values and leaves everything else as it is.
//   - The schema types a panel's `options` as Record<string, unknown> and its `targets` and annotation `target` as
//     a bare DataQuery; @grafana/schema ships no Prometheus query type. PagekeeperDashboard narrows them: options
//     and custom field config per panel type, targets as Prometheus queries (PromTarget, below, the fields of
//     Grafana's PromQuery that we use). The result must still be assignable to Grafana's Dashboard (checked by
//     the last line of the generated file).

import type {
  AnnotationQuery,
  Dashboard,
  DataQuery,
  FieldConfig,
  FieldConfigSource,
  Panel,
  RowPanel,
  VariableModel,
} from '@grafana/schema';
import type * as Gauge from '@grafana/schema/dist/esm/raw/composable/gauge/panelcfg/x/GaugePanelCfg_types.gen';
import type * as Stat from '@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen';
import type * as TimeSeries from '@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen';

/** T as it reads in JSON: string enums become the union of their values; objects and arrays recursively. */
export type Json<T> = T extends string
  ? `${T}`
  : T extends number | boolean | null | undefined
    ? T
    : T extends ReadonlyArray<infer U>
      ? Array<Json<U>>
      : T extends object
        ? { [K in keyof T]: Json<T[K]> }
        : T;

/** Every panel, target and variable reads from the dashboard's Prometheus data source variable. */
export type PromDatasource = { type: 'prometheus'; uid: '${datasource}' };

/** A Prometheus query target (the fields of Grafana's PromQuery that this dashboard uses). */
export type PromTarget = Omit<Json<DataQuery>, 'datasource'> & {
  datasource: PromDatasource;
  expr: string;
  legendFormat?: string;
  range?: boolean;
  instant?: boolean;
  format?: 'time_series' | 'table' | 'heatmap';
  interval?: string;
  editorMode?: 'code' | 'builder';
  exemplar?: boolean;
};

/** fieldConfig with the plugin's own `custom` field config (none for stat and gauge). */
type FieldConfigOf<Custom> = {
  defaults: Omit<Json<FieldConfig>, 'custom'> & { custom?: Json<Custom> };
  overrides: Json<FieldConfigSource>['overrides'];
};

type PanelCommon = Omit<Json<Panel>, 'type' | 'options' | 'fieldConfig' | 'targets' | 'datasource'> & {
  id: number;
  title: string;
  gridPos: Json<NonNullable<Panel['gridPos']>>;
  datasource: PromDatasource;
  targets: PromTarget[];
};

export type TimeSeriesPanel = PanelCommon & {
  type: 'timeseries';
  options: Json<TimeSeries.Options>;
  fieldConfig: FieldConfigOf<TimeSeries.FieldConfig>;
};

export type StatPanel = PanelCommon & {
  type: 'stat';
  options: Json<Stat.Options>;
  fieldConfig: FieldConfigOf<never>;
};

export type GaugePanel = PanelCommon & {
  type: 'gauge';
  options: Json<Gauge.Options>;
  fieldConfig: FieldConfigOf<never>;
};

/** An expanded row: its panels follow it at the top level. */
export type Row = Omit<Json<RowPanel>, 'panels'> & { type: 'row'; title: string; collapsed: false; panels: [] };

/** Grafana's built-in "Annotations & Alerts". */
export type BuiltInAnnotation = Json<AnnotationQuery> & { builtIn: 1; type: 'dashboard' };

/** A Prometheus annotation query, in the shape the Prometheus data source reads (target + display fields). */
export type PromAnnotation = Omit<Json<AnnotationQuery>, 'target' | 'datasource'> & {
  datasource: PromDatasource;
  target: PromTarget;
  titleFormat?: string;
  textFormat?: string;
  tagKeys?: string;
  useValueForTime?: boolean;
};

export type PagekeeperDashboard = Omit<Json<Dashboard>, 'panels' | 'annotations' | 'templating'> & {
  title: string;
  uid: string;
  panels: Array<TimeSeriesPanel | StatPanel | GaugePanel | Row>;
  annotations: { list: Array<BuiltInAnnotation | PromAnnotation> };
  templating: { list: Array<Json<VariableModel>> };
};

/** Compile-time proof that a PagekeeperDashboard is a Grafana Dashboard (enums spelled as in JSON). */
export type GrafanaDashboard = Json<Dashboard>;

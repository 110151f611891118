"""Teams and identity: `teams` (name, fair-share weight), `team_members` (a database role in a
team, perhaps its admin) and `jobs.team` (the submitting role's team); on PostgreSQL, the roles'
privileges and the row-level security policies that decide who may do what.

On PostgreSQL a person's or a flow's identity is the database role it connects as
(`current_user`); the database itself refuses what a role may not do:

- jobs: a role sees its own jobs, its teams' jobs, and an operator every job; it submits only as
  itself (`submitted_by` = current_user) and for a team it belongs to (no team while no team is
  defined); it changes (cancels, renews, ends, reports on) a job it owns or one of a team it
  administers; an operator changes any. A policy pass over the whole queue is an operator's
  (the decider, `forgeflow cluster serve`, runs as one).
- allocations: visible to every role (which GPU is busy is no secret); made by an operator (the
  decider's admissions); renewed or released by whoever may change the job.
- nodes, GPUs, clusters: registering an inventory and changing nodes is an operator's; cordoning
  is an operator's, or a role's whose job holds the node (a flow cordons a node its job found
  faulty). Every role may bump a cluster's `state_version` and `pass_pending` (the scheduler
  lock and its change log), nothing else of it.
- job_launches: only whoever may change the job reads or records what its nodes run.
- teams and team_members (and 0009's quotas, priority classes and caps): readable by all,
  written by an operator.

FORCE ROW LEVEL SECURITY: the tables' owner obeys the policies too; the role that runs this
migration is made an operator (it owns the schema and may run the decider). The operator role
(FORGEFLOW_OPERATOR_ROLE, default forgeflow_operator) is created NOLOGIN if missing. Roles get
their table privileges through PUBLIC, with the row-level security deciding which rows; a table
of a later revision is readable by every role and written by the operator role only, unless that
revision grants more (default privileges). SQLite is single-user: none of this applies.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28
"""

from alembic import op
import sqlalchemy as sa

from infra.statedb.identity import operator_role

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

GUARDED = ("jobs", "allocations", "nodes", "gpus", "clusters", "job_launches")


def upgrade() -> None:
    op.create_table(
        "teams",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("weight", sa.Float(precision=53), nullable=False, server_default="1"),
    )
    op.create_table(
        "team_members",
        sa.Column("member", sa.Text, primary_key=True),
        sa.Column("team", sa.Text, sa.ForeignKey("teams.name"), primary_key=True),
        sa.Column("is_admin", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("team", sa.Text, nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        _postgres_roles_and_policies(operator_role())


def _postgres_roles_and_policies(operator: str) -> None:
    run = op.execute
    run(f"""DO $$ BEGIN
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{operator}') THEN
            CREATE ROLE "{operator}" NOLOGIN;
        END IF;
        IF NOT pg_has_role(current_user, '{operator}', 'MEMBER') THEN
            EXECUTE 'GRANT "{operator}" TO ' || quote_ident(current_user);
        END IF;
    END $$""")
    # Who the caller is to the policies. Inside the functions every name is schema-qualified, so a
    # role cannot shadow team_members (or a function) with its own in an earlier schema of its
    # search_path; in a policy, ((SELECT forgeflow_is_operator())) is evaluated once per statement.
    s = _schema()
    run(f"CREATE OR REPLACE FUNCTION {s}.forgeflow_operator_role() RETURNS text LANGUAGE sql IMMUTABLE "
        f"AS $$ SELECT '{operator}'::text $$")
    run(f"CREATE OR REPLACE FUNCTION {s}.forgeflow_is_operator() RETURNS boolean LANGUAGE sql STABLE "
        f"AS $$ SELECT pg_catalog.pg_has_role(current_user, {s}.forgeflow_operator_role(), 'MEMBER') $$")
    run(f"CREATE OR REPLACE FUNCTION {s}.forgeflow_in_team(t text) RETURNS boolean LANGUAGE sql STABLE "
        f"AS $$ SELECT EXISTS (SELECT 1 FROM {s}.team_members m WHERE m.team = t "
        "AND m.member = current_user::text) $$")
    run(f"CREATE OR REPLACE FUNCTION {s}.forgeflow_team_admin(t text) RETURNS boolean LANGUAGE sql STABLE "
        f"AS $$ SELECT EXISTS (SELECT 1 FROM {s}.team_members m WHERE m.team = t "
        "AND m.member = current_user::text AND m.is_admin) $$")
    run(f"CREATE OR REPLACE FUNCTION {s}.forgeflow_may_see_job(owner text, t text) RETURNS boolean LANGUAGE sql "
        f"STABLE AS $$ SELECT owner = current_user::text OR {s}.forgeflow_in_team(t) OR {s}.forgeflow_is_operator() $$")
    run(f"CREATE OR REPLACE FUNCTION {s}.forgeflow_may_change_job(owner text, t text) RETURNS boolean LANGUAGE sql "
        f"STABLE AS $$ SELECT owner = current_user::text OR {s}.forgeflow_team_admin(t) "
        f"OR {s}.forgeflow_is_operator() $$")
    run(f"CREATE OR REPLACE FUNCTION {s}.forgeflow_may_change_job_id(job integer) RETURNS boolean LANGUAGE sql "
        f"STABLE AS $$ SELECT EXISTS (SELECT 1 FROM {s}.jobs j WHERE j.id = job "
        f"AND {s}.forgeflow_may_change_job(j.submitted_by, j.team)) $$")
    run(f"CREATE OR REPLACE FUNCTION {s}.forgeflow_holds_node(c text, n text) RETURNS boolean LANGUAGE sql STABLE "
        f"AS $$ SELECT EXISTS (SELECT 1 FROM {s}.allocations a JOIN {s}.jobs j ON j.id = a.job_id "
        "WHERE a.cluster = c AND a.node = n AND a.released_at IS NULL "
        f"AND {s}.forgeflow_may_change_job(j.submitted_by, j.team)) $$")

    # Privileges: every role through PUBLIC, the rows decided by the policies below.
    run("GRANT USAGE ON SCHEMA " + _schema() + " TO PUBLIC")
    run("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA " + _schema() + " TO PUBLIC")
    run("GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA " + _schema() + " TO PUBLIC")
    # Tables of later revisions: readable by every role, written by the operator role unless that
    # revision grants more (the quota and priority-class tables of 0009 are an operator's alone).
    run("ALTER DEFAULT PRIVILEGES IN SCHEMA " + _schema() + " GRANT SELECT ON TABLES TO PUBLIC")
    run("ALTER DEFAULT PRIVILEGES IN SCHEMA " + _schema()
        + f' GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO "{operator}"')
    run("ALTER DEFAULT PRIVILEGES IN SCHEMA " + _schema() + " GRANT USAGE, SELECT ON SEQUENCES TO PUBLIC")
    run("REVOKE INSERT, UPDATE, DELETE ON alembic_version, teams, team_members FROM PUBLIC")
    run("REVOKE UPDATE ON clusters FROM PUBLIC")
    run("GRANT UPDATE (state_version, pass_pending) ON clusters TO PUBLIC")
    run(f'GRANT SELECT, INSERT, UPDATE, DELETE ON teams, team_members, clusters TO "{operator}"')

    for table in GUARDED:
        run(f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY")
        run(f"ALTER TABLE {table} FORCE ROW LEVEL SECURITY")
    operator_only = "((SELECT forgeflow_is_operator()))"
    policies = [
        # jobs
        f"CREATE POLICY jobs_see ON jobs FOR SELECT USING ({operator_only} OR "
        "forgeflow_may_see_job(submitted_by, team))",
        "CREATE POLICY jobs_submit ON jobs FOR INSERT WITH CHECK (submitted_by = current_user::text AND "
        "(forgeflow_in_team(team) OR (team IS NULL AND (NOT EXISTS (SELECT 1 FROM teams) "
        f"OR {operator_only}))))",
        f"CREATE POLICY jobs_change ON jobs FOR UPDATE USING ({operator_only} OR "
        f"forgeflow_may_see_job(submitted_by, team)) WITH CHECK ({operator_only} OR forgeflow_may_change_job(submitted_by, team))",
        f"CREATE POLICY jobs_delete ON jobs FOR DELETE USING {operator_only}",
        # allocations
        "CREATE POLICY allocations_see ON allocations FOR SELECT USING (true)",
        f"CREATE POLICY allocations_admit ON allocations FOR INSERT WITH CHECK {operator_only}",
        "CREATE POLICY allocations_change ON allocations FOR UPDATE USING (true) "
        f"WITH CHECK ({operator_only} OR forgeflow_may_change_job_id(job_id))",
        f"CREATE POLICY allocations_delete ON allocations FOR DELETE USING {operator_only}",
        # nodes: an operator; a cordon by a role whose job holds the node
        "CREATE POLICY nodes_see ON nodes FOR SELECT USING (true)",
        f"CREATE POLICY nodes_add ON nodes FOR INSERT WITH CHECK {operator_only}",
        "CREATE POLICY nodes_change ON nodes FOR UPDATE USING (true) "
        f"WITH CHECK ({operator_only} OR (state = 'cordoned' AND forgeflow_holds_node(cluster, name)))",
        f"CREATE POLICY nodes_remove ON nodes FOR DELETE USING {operator_only}",
        # gpus and clusters: the inventory is an operator's (clusters' lock columns: see the grants)
        "CREATE POLICY gpus_see ON gpus FOR SELECT USING (true)",
        f"CREATE POLICY gpus_inventory ON gpus FOR ALL USING {operator_only} WITH CHECK {operator_only}",
        "CREATE POLICY clusters_see ON clusters FOR SELECT USING (true)",
        f"CREATE POLICY clusters_register ON clusters FOR INSERT WITH CHECK {operator_only}",
        "CREATE POLICY clusters_lock ON clusters FOR UPDATE USING (true) WITH CHECK (true)",
        f"CREATE POLICY clusters_remove ON clusters FOR DELETE USING {operator_only}",
        # job_launches: what a job's nodes run, for whoever may change the job
        f"CREATE POLICY job_launches_own ON job_launches FOR ALL USING ({operator_only} OR "
        f"forgeflow_may_change_job_id(job_id)) WITH CHECK ({operator_only} OR forgeflow_may_change_job_id(job_id))",
    ]
    for policy in policies:
        run(policy)


def _schema() -> str:
    return '"' + op.get_bind().execute(sa.text("SELECT current_schema()")).scalar() + '"'


POLICIES = {
    "jobs": ("jobs_see", "jobs_submit", "jobs_change", "jobs_delete"),
    "allocations": ("allocations_see", "allocations_admit", "allocations_change", "allocations_delete"),
    "nodes": ("nodes_see", "nodes_add", "nodes_change", "nodes_remove"),
    "gpus": ("gpus_see", "gpus_inventory"),
    "clusters": ("clusters_see", "clusters_register", "clusters_lock", "clusters_remove"),
    "job_launches": ("job_launches_own",),
}


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table, names in POLICIES.items():
            for name in names:
                op.execute(f"DROP POLICY IF EXISTS {name} ON {table}")
            op.execute(f"ALTER TABLE {table} NO FORCE ROW LEVEL SECURITY")
            op.execute(f"ALTER TABLE {table} DISABLE ROW LEVEL SECURITY")
        for fn in ("forgeflow_holds_node(text, text)", "forgeflow_may_change_job_id(integer)",
                   "forgeflow_may_change_job(text, text)", "forgeflow_may_see_job(text, text)",
                   "forgeflow_team_admin(text)", "forgeflow_in_team(text)", "forgeflow_is_operator()",
                   "forgeflow_operator_role()"):
            op.execute(f"DROP FUNCTION IF EXISTS {fn}")
        op.execute("GRANT UPDATE ON clusters TO PUBLIC")  # the operator role itself is kept (roles are cluster-wide)
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("team")
    op.drop_table("team_members")
    op.drop_table("teams")

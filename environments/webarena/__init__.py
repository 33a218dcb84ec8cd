"""WebArena, reached only through a remote AgentGym env server.

WebArena needs live web sites (shopping, GitLab, Reddit, maps, CMS), so there is no local
environment here: `environments.make("remote", url=..., env_name="webarena")` talks to an
AgentGym WebArena server. This package ships the task-id split that AgentGym-RL trains and
evaluates on (372 train / 50 test ids of WebArena's 812 tasks, from AgentGym-RL's
`AgentItemId/{train,test}/webarena_*.json`), and the site of each test task as its category
(WebArena's task configs' `sites`, the first one for the few multi-site tasks), which groups
the evaluation into the paper's Shopping, CMS, Maps and GitLab+Reddit columns.
"""

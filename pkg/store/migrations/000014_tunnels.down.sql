DROP TABLE gateways;
DROP TABLE ssh_user_cas;
DROP TABLE tunnel_tickets;
